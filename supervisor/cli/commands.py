"""What each `kimi-serve` command does, once its arguments are parsed (cli.parser).

Each `cmd_*` takes the parsed arguments, stdout and stderr and returns the exit status. What a
command needs beyond the configuration it imports itself: no command loads another's code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from supervisor import config as config_mod
from supervisor.config import Config, ConfigError
from supervisor.exits import EX_CONFIG, EX_FAIL, EX_NOPERM, EX_OK


def _load(args: argparse.Namespace, err: TextIO) -> Config | None:
    path = config_mod.resolve_path(args.config)
    try:
        return config_mod.load(path)
    except ConfigError as exc:
        print(exc.render(), file=err)
        return None


def cmd_check(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.json:
        return _check_json(args, out)
    cfg = _load(args, err)
    if cfg is None:
        return EX_CONFIG
    for warning in _check_warnings(cfg):
        print(warning, file=err)
    owners = _cache_owner_errors(cfg)
    for problem in owners:
        where = f"{cfg.path}:{problem['line']}" if problem["line"] else cfg.path
        print(f"{where}: {problem['key']}: {problem['message']}", file=err)
    if owners:
        return EX_CONFIG
    print("ok", file=out)
    return EX_OK


def _cache_owner_errors(cfg: Config) -> list[dict[str, Any]]:
    """A cache directory another user could write is a config error (docs/security.md)."""
    from supervisor.sglang import argv

    line = cfg.key_lines.get("warm.cache_dir")
    return [
        {"key": "warm.cache_dir", "line": line, "message": problem}
        for problem in argv.cache_owner_problems(cfg)
    ]


def _check_warnings(cfg: Config) -> list[str]:
    from supervisor import router
    from supervisor.sglang import argv

    clear = router.key_in_clear(cfg.router)
    return [
        *(f"warning: {w}" for w in config_mod.launch_warnings(cfg)),
        *(
            f"{cfg.path}: warning: {w}"
            for w in [*config_mod.warnings(cfg), *([clear] if clear else [])]
        ),
        *(f"{cfg.path}: warning: warm.cache_dir: {p}" for p in argv.cache_problems(cfg)),
    ]


def _check_json(args: argparse.Namespace, out: TextIO) -> int:
    """`check --json`: {ok, config, errors [{key, line, message}], warnings}; 0 / 78 as without."""
    import json

    path = config_mod.resolve_path(args.config)
    try:
        cfg = config_mod.load(path)
    except ConfigError as exc:
        errors = [{"key": i.path, "line": i.line, "message": i.message} for i in exc.issues]
        print(json.dumps({"ok": False, "config": path, "errors": errors, "warnings": []}), file=out)
        return EX_CONFIG
    owners = _cache_owner_errors(cfg)
    doc = {"ok": not owners, "config": cfg.path, "errors": owners, "warnings": _check_warnings(cfg)}
    print(json.dumps(doc), file=out)
    return EX_CONFIG if owners else EX_OK


def cmd_print_command(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from supervisor.sglang import argv

    cfg = _load(args, err)
    if cfg is None:
        return EX_CONFIG
    profile = args.profile or config_mod.PRIMARY
    if profile not in cfg.profile_names:
        print(
            f"{cfg.path}: profile {profile!r} is not defined "
            f"(profiles: {', '.join(cfg.profile_names)})",
            file=err,
        )
        return EX_CONFIG
    spec = argv.build(cfg, profile)
    print(spec.shell(), file=out)
    for line in spec.env_lines():
        print(f"env: {line}", file=out)
    return EX_OK


def _open_nvml() -> Any:
    """Real NVML, or the simulation where tests and the demo ask for it (gpu_sim's variables).

    Chosen here, at the edge: the daemon and the GPU code only ever get an opener."""
    from supervisor.gpu import sim as gpu_sim

    return gpu_sim.open_nvml()


def cmd_run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from supervisor import log
    from supervisor.daemon import adoption
    from supervisor.daemon.effects import Effects
    from supervisor.daemon.loop import Daemon
    from supervisor.daemon.wiring import wire

    cfg = _load(args, err)
    if cfg is None:
        from supervisor.daemon.notify import Notifier

        Notifier().status("failed to start: configuration invalid (see the log)")
        adoption.abandon("the configuration is invalid")
        return EX_CONFIG
    problem = _token_file_problem(cfg)
    if problem:
        from supervisor.daemon.notify import Notifier

        print(problem, file=err)
        Notifier().status(f"failed to start: {problem}")
        adoption.abandon(problem)
        return EX_CONFIG
    log.setup(cfg.logging.format, cfg.logging.level)
    fx = Effects.real(cfg, open_nvml=_open_nvml)
    return asyncio.run(Daemon(cfg, fx, wire(cfg, fx)).run())


def _token_file_problem(cfg: Config) -> str | None:
    """An existing token file that others could read, or a directory for it that others
    could write: refused before anything starts, with 78, since no restart fixes it. (An
    absent file is created by the admin endpoint.)"""
    from supervisor import secret_files

    path = cfg.admin.token_file
    directory = Path(path).parent
    try:
        if os.path.lexists(path):
            secret_files.load(path)
        elif directory.is_dir():
            secret_files.check_directory(directory)
    except secret_files.TokenFileError as exc:
        return f"{exc.message} (admin.token_file in {cfg.path})"
    g = cfg.group
    if g.peers and g.token_file != path:
        # The token presented to the peers: held to the same rules (it opens their endpoints).
        try:
            secret_files.load(g.token_file)
        except secret_files.TokenFileError as exc:
            return f"{exc.message} (group.token_file in {cfg.path})"
    key = cfg.router.api_key_file
    if key is not None:
        # Sent to the router: others must not read it, nor swap it for a key of their own.
        try:
            secret_files.read_secret(key, "router.api_key_file")
        except secret_files.TokenFileError as exc:
            return f"{exc.message} (router.api_key_file in {cfg.path})"
    from supervisor.sglang import argv

    for problem in argv.cache_owner_problems(cfg):
        return f"{problem} (warm.cache_dir in {cfg.path})"
    return None


def cmd_probe(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import httpx

    from supervisor.sglang import api_key as sglang_key
    from supervisor.sglang import argv
    from supervisor.sglang.probe import probe, server_url

    cfg = _load(args, err)
    if cfg is None:
        return EX_CONFIG
    url = args.url or server_url(cfg.sglang.host, cfg.sglang.port)
    speculative = argv.build(cfg).speculative

    try:
        # Root's CLI reads the service user's key file as it is (owner aside).
        auth = sglang_key.auth_for(cfg, url, owners=())
    except sglang_key.KeyFileError as exc:
        print(f"error: sglang.api_key_file: {exc}", file=err)
        return EX_CONFIG

    async def once() -> Any:
        async with httpx.AsyncClient(trust_env=False, auth=auth) as client:
            return await probe(client, url, cfg.readiness.probe, speculative)

    result = asyncio.run(once())
    verdict = "ok" if result.ok else f"FAILED ({result.reason})"
    print(f"probe {url} ({cfg.readiness.probe.endpoint}): {verdict}", file=out)
    print(f"  latency: {result.latency_s * 1000:.1f} ms", file=out)
    print(f"  completion_tokens: {result.completion_tokens}", file=out)
    if result.spec_verify_ct is not None:
        print(f"  spec_verify_ct: {result.spec_verify_ct}", file=out)
    if result.text is not None:
        print(f"  text: {result.text!r}", file=out)
    if result.error:
        print(f"  error: {result.error}", file=out)
    return EX_OK if result.ok else EX_FAIL


def cmd_preflight(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from supervisor import preflight

    cfg = _load(args, err)
    if cfg is None:
        return EX_CONFIG
    return preflight.run_preflight_command(cfg, out, open_nvml=_open_nvml, as_json=args.json)


def cmd_gpu_clean(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from supervisor import gpu

    cfg = _load(args, err)
    if cfg is None:
        return EX_CONFIG
    return gpu.run_gpu_clean(cfg, args.dry_run, out, _open_nvml)


def cmd_status(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from supervisor import secret_files
    from supervisor.admin import status_command as status
    from supervisor.admin import wait as waiting

    # With --url the daemon is found without the config file (and the token with --token-file).
    if args.url:
        try:
            token = _token_if_readable(args.token_file)
        except secret_files.TokenFileError as exc:
            print(f"kimi-serve status: {exc.message}", file=err)
            return EX_NOPERM
        trusted = secret_files.service_uids(args.token_file) if args.token_file else None
        if args.watch:
            return waiting.run_watch_command(
                args.url, args.timeout, args.json, out, err, token, trusted
            )
        return status.run_status_command(args.url, args.json, out, err, token, trusted)
    path = config_mod.resolve_path(args.config)
    if path == config_mod.DEFAULT_CONFIG_PATH and not os.path.lexists(path):
        # No config here (a host set up by hand, a container): the defaults of the shipped
        # config, said on stderr so nobody mistakes them for the service's.
        from supervisor.config import settings

        base = f"http://{settings.setting('admin.listen').default}"
        token_file = args.token_file or config_mod.default_token_file("")
        print(
            f"kimi-serve status: no config file {path}; asking {base} "
            f"with the token file {token_file} (the defaults; --config FILE for others)",
            file=err,
        )
    else:
        cfg = _load(args, err)
        if cfg is None:
            return EX_CONFIG
        token_file = args.token_file or cfg.admin.token_file
        base = f"http://{cfg.admin.listen}"
    try:
        token = _token_if_readable(token_file)
    except secret_files.TokenFileError as exc:
        print(f"kimi-serve status: {exc.message}", file=err)
        return EX_NOPERM
    trusted = secret_files.service_uids(token_file)
    if args.watch:
        return waiting.run_watch_command(base, args.timeout, args.json, out, err, token, trusted)
    return status.run_status_command(base, args.json, out, err, token, trusted)


def _token_if_readable(path: str | None) -> str | None:
    """`status` uses the token when this user may read it, and goes without it silently
    when the file is absent or not this user's to read. One it may read but that is not a
    usable token file (malformed, unsafe modes, a planted link) is TokenFileError: an error,
    never quietly a status without the token."""
    from supervisor import secret_files

    if not path or not os.path.exists(path) or not os.access(path, os.R_OK):
        return None
    return secret_files.read_for_client(path)


def cmd_operation(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from supervisor.admin import control_commands as control

    if args.url and args.token_file:
        return control.run(control.request_of(args, args.url, args.token_file), out, err)
    cfg = _load(args, err)
    if cfg is None:
        return EX_CONFIG
    base = args.url or f"http://{cfg.admin.listen}"
    token_file = args.token_file or cfg.admin.token_file
    return control.run(control.request_of(args, base, token_file), out, err)


def cmd_upgrade(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from supervisor.admin import upgrade_command

    if args.url and args.token_file:
        return upgrade_command.run(args, args.url, args.token_file, sys.stdin, out, err)
    cfg = _load(args, err)
    if cfg is None:
        return EX_CONFIG
    base = args.url or f"http://{cfg.admin.listen}"
    token_file = args.token_file or cfg.admin.token_file
    return upgrade_command.run(args, base, token_file, sys.stdin, out, err)


def cmd_incidents(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from supervisor import incidents
    from supervisor.incidents import cli as incidents_cli

    cfg = _load(args, err)
    if cfg is None:
        return EX_CONFIG
    store = incidents.IncidentStore(cfg.incidents)
    if args.action == "show":
        if not args.id:
            print(
                "kimi-serve incidents show: which one? (an ID from `kimi-serve incidents`, "
                "or last)",
                file=err,
            )
            return 2
        return incidents_cli.run_show(store, args.id, args.json, out, err)
    return incidents_cli.run_list(store, args.json, out, err)


def cmd_canary(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from supervisor.quality import canary_cli

    cfg = _load(args, err)
    if cfg is None:
        return EX_CONFIG
    return canary_cli.run(args, cfg, sys.stdin, out, err)


def cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from supervisor import demo

    return demo.run_demo(
        args.fault, out, err, load_seconds=args.load_seconds, duration=args.duration
    )
