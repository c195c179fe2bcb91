"""Configuration, one parser per section: raw YAML (through `config_reader._Reader`) into that
section's frozen dataclass (`config_types`), with the section's known keys and defaults.

`supervisor.config.parse` calls them in order; checks across sections are in `config_checks`.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

from supervisor.config.convert import (
    _bool,
    _choice,
    _devices,
    _env_filled,
    _floor,
    _host,
    _http_url,
    _int_in,
    _kind,
    _opt_absolute_path,
    _opt_http_url,
    _opt_key_file,
    _opt_readable_file,
    _opt_regex,
    _opt_string,
    _positive_duration,
    _prewarm,
    _regex_list,
    _string,
    _string_list,
    expand_env,
    is_loopback_url,
    parse_duration,
    parse_listen,
    parse_size,
)
from supervisor.config.reader import _Reader
from supervisor.config.types import (
    CANARY_POLICIES,
    DEFAULT_CANARY_PROMPT,
    DEFAULT_FATAL_PATTERNS,
    INCIDENTS_MAX_BYTES,
    INCIDENTS_MIN_FREE,
    PRIMARY,
    RESERVED_ARGS,
    RESTART_MODES,
    SPEC_COLLAPSE_ACTIONS,
    TP_ARGS,
    AdminConfig,
    ArgValue,
    CanaryConfig,
    Config,
    CrashLoopConfig,
    GpusConfig,
    GroupConfig,
    IncidentsConfig,
    LivenessConfig,
    LoggingConfig,
    LogsConfig,
    ProbeConfig,
    Profile,
    QualityConfig,
    ReadinessConfig,
    RestartConfig,
    RouterConfig,
    SGLangConfig,
    WarmConfig,
)


def _args(r: _Reader, raw: object, path: str) -> dict[str, ArgValue]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        r.error(path, f"expected a mapping of flag name -> value, got {_kind(raw)}")
        return {}
    out: dict[str, ArgValue] = {}
    for key, value in raw.items():
        sub = f"{path}.{key}"
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", key):
            r.error(
                sub,
                f"flag name {key!r} must be written without leading dashes "
                "(e.g. tp-size: 8 for --tp-size 8)",
            )
            continue
        if key in RESERVED_ARGS:
            r.error(sub, f"--{key} is set from {RESERVED_ARGS[key]}; remove it from args")
            continue
        if isinstance(value, list):
            if not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in value):
                r.error(sub, "a list value may only hold strings and numbers")
                continue
            if not value:
                # `--name` with no values is an argparse error for nargs="+" flags.
                r.error(sub, "is an empty list; write null to leave the flag out")
                continue
            out[key] = tuple(_expanded(r, sub, v) for v in value)
        elif isinstance(value, str):
            out[key] = _expanded(r, sub, value)
        elif value is None or isinstance(value, int | float | bool):
            out[key] = value
        else:
            # A date, a mapping, !!binary ...: str() of it is not what SGLang expects.
            r.error(sub, f"expected a string, number, boolean, list or null; got {_kind(value)}")
    return out


def _expanded(r: _Reader, path: str, value: str | int | float) -> str | int | float:
    """A string of SGLang's args with `${NAME}` filled in; every variable unset or empty is an
    issue at `path`."""
    if not isinstance(value, str):
        return value
    filled, problems = expand_env(value)
    for problem in problems:
        r.error(path, problem)
    return filled


def _env(r: _Reader, raw: object, path: str, allow_null: bool) -> dict[str, str | None]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        r.error(path, f"expected a mapping of NAME -> string, got {_kind(raw)}")
        return {}
    out: dict[str, str | None] = {}
    for key, value in raw.items():
        sub = f"{path}.{key}"
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            r.error(sub, f"{key!r} is not a valid environment variable name")
        elif value is None and allow_null:
            out[key] = None
        elif isinstance(value, str):
            out[key] = value
        else:
            r.error(sub, f"environment values must be strings (quote them), got {_kind(value)}")
    return out


def _sglang(r: _Reader, raw: object) -> SGLangConfig:
    p = "sglang"
    s = r.section(
        raw,
        p,
        (
            *("python", "module", "model_path", "host", "port", "args", "env", "workdir"),
            "api_key_file",
        ),
    )
    if raw is None:
        r.error(p, "is required but missing (at least sglang.model_path)")
    env = _env(r, s.get("env"), f"{p}.env", allow_null=False)
    return SGLangConfig(
        python=r.get(s, p, "python", _string, "/opt/sglang/venv/bin/python"),
        module=r.get(s, p, "module", _string, "sglang.launch_server"),
        model_path=r.get(s, p, "model_path", _string),
        host=r.get(s, p, "host", _host, "127.0.0.1"),
        port=r.get(s, p, "port", _int_in(1, 65535), 30000),
        args=_args(r, s.get("args"), f"{p}.args"),
        env={k: v for k, v in env.items() if v is not None},
        workdir=r.get(s, p, "workdir", _opt_string, None),
        api_key_file=r.get(s, p, "api_key_file", _opt_key_file, None),
    )


def _profiles(r: _Reader, raw: object) -> dict[str, Profile]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        r.error("profiles", f"expected a mapping of profile name -> overlay, got {_kind(raw)}")
        return {}
    out: dict[str, Profile] = {}
    for name, body in raw.items():
        p = f"profiles.{name}"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            r.error(p, f"profile name {name!r} may use letters, digits, '-' and '_' only")
            continue
        if name == PRIMARY:
            r.error(p, "'primary' is the base sglang section itself; pick another profile name")
            continue
        s = r.section(body, p, ("args", "env"))
        out[name] = Profile(
            name=name,
            args=_args(r, s.get("args"), f"{p}.args"),
            env=_env(r, s.get("env"), f"{p}.env", allow_null=True),
        )
    return out


def _readiness(r: _Reader, raw: object) -> ReadinessConfig:
    p = "readiness"
    s = r.section(raw, p, ("load_timeout", "probe"))
    pp = f"{p}.probe"
    ps = r.section(
        s.get("probe"), pp, ("endpoint", "prompt", "max_tokens", "timeout", "expect_regex")
    )
    probe = ProbeConfig(
        endpoint=r.get(ps, pp, "endpoint", _choice("generate", "chat"), "generate"),
        prompt=r.get(ps, pp, "prompt", _string, "Say hello in one word"),
        # At least 2 tokens: one token is what /health checks and cannot see the decode loop.
        max_tokens=r.get(ps, pp, "max_tokens", _int_in(2, 4096), 8),
        timeout=r.get(ps, pp, "timeout", _positive_duration, 30.0),
        expect_regex=r.get(ps, pp, "expect_regex", _opt_regex, None),
    )
    return ReadinessConfig(
        load_timeout=r.get(s, p, "load_timeout", _positive_duration, 1800.0), probe=probe
    )


def _liveness(r: _Reader, raw: object) -> LivenessConfig:
    p = "liveness"
    s = r.section(raw, p, ("interval", "timeout", "failure_threshold"))
    return LivenessConfig(
        interval=r.get(s, p, "interval", _positive_duration, 15.0),
        timeout=r.get(s, p, "timeout", _positive_duration, 20.0),
        failure_threshold=r.get(s, p, "failure_threshold", _int_in(1, 1000), 3),
    )


def _restart(r: _Reader, raw: object) -> RestartConfig:
    p = "restart"
    s = r.section(
        raw,
        p,
        (
            "backoff_initial",
            "backoff_max",
            "crash_loop",
            "fallback_profile",
            "stable_after",
            "mode",
        ),
    )
    cp = f"{p}.crash_loop"
    cs = r.section(s.get("crash_loop"), cp, ("max_restarts", "window"))
    return RestartConfig(
        backoff_initial=r.get(s, p, "backoff_initial", parse_duration, 5.0),
        backoff_max=r.get(s, p, "backoff_max", _positive_duration, 300.0),
        crash_loop=CrashLoopConfig(
            max_restarts=r.get(cs, cp, "max_restarts", _int_in(1, 10000), 5),
            window=r.get(cs, cp, "window", _positive_duration, 3600.0),
        ),
        fallback_profile=r.get(s, p, "fallback_profile", _opt_string, None),
        stable_after=r.get(s, p, "stable_after", _positive_duration, 600.0),
        mode=r.get(s, p, "mode", _choice(*RESTART_MODES), "relaunch"),
    )


def _gpus(r: _Reader, raw: object) -> GpusConfig:
    p = "gpus"
    s = r.section(
        raw,
        p,
        (
            "manage",
            "devices",
            "leftover_policy",
            "match",
            "memory_free_timeout",
            "memory_free_threshold_mib",
        ),
    )
    return GpusConfig(
        manage=r.get(s, p, "manage", _bool, True),
        devices=r.get(s, p, "devices", _devices, "all"),
        leftover_policy=r.get(
            s, p, "leftover_policy", _choice("kill-matching", "report-only"), "kill-matching"
        ),
        match=r.get(s, p, "match", _string_list, ("sglang", "launch_server")),
        memory_free_timeout=r.get(s, p, "memory_free_timeout", _positive_duration, 60.0),
        memory_free_threshold_mib=r.get(
            s, p, "memory_free_threshold_mib", _int_in(0, 10_000_000), 1024
        ),
    )


def _admin(r: _Reader, raw: object, state_dir: str) -> AdminConfig:
    p = "admin"
    s = r.section(raw, p, ("listen", "token_file", "allow_remote"))
    listen = r.get(s, p, "listen", lambda v: parse_listen(_string(v)), ("127.0.0.1", 29400))
    host, port = listen if listen else ("127.0.0.1", 29400)
    token_file = r.get(s, p, "token_file", _opt_absolute_path, None)
    return AdminConfig(
        host=host,
        port=port,
        token_file=token_file or default_token_file(state_dir),
        allow_remote=r.get(s, p, "allow_remote", _bool, False),
    )


def default_token_file(state_dir: str) -> str:
    # The state directory, not $RUNTIME_DIRECTORY: the CLI (outside the unit) finds it from the
    # same config, and the token survives daemon restarts, so a copy held by a proxy or a peer
    # stays valid (docs/security.md).
    return os.path.join(state_dir or default_state_dir(), "admin.token")


def default_state_dir() -> str:
    # systemd's StateDirectory= exports STATE_DIRECTORY (possibly several, colon-separated).
    env = os.environ.get("STATE_DIRECTORY")
    return env.split(":")[0] if env else "/var/lib/kimi-serve"


def _logs(r: _Reader, raw: object) -> LogsConfig:
    p = "logs"
    s = r.section(raw, p, ("fatal_patterns", "tail_lines"))
    return LogsConfig(
        fatal_patterns=r.get(s, p, "fatal_patterns", _regex_list, DEFAULT_FATAL_PATTERNS),
        tail_lines=r.get(s, p, "tail_lines", _int_in(1, 100_000), 200),
    )


def _logging(r: _Reader, raw: object) -> LoggingConfig:
    p = "logging"
    s = r.section(raw, p, ("format", "level"))
    return LoggingConfig(
        format=r.get(s, p, "format", _choice("json", "console"), "json"),
        level=r.get(s, p, "level", _choice("debug", "info", "warning", "error"), "info"),
    )


def default_cache_dir(state_dir: str) -> str:
    # systemd's CacheDirectory= exports CACHE_DIRECTORY (possibly several, colon-separated).
    env = os.environ.get("CACHE_DIRECTORY")
    return env.split(":")[0] if env else os.path.join(state_dir, "cache")


def _warm(r: _Reader, raw: object, state_dir: str) -> WarmConfig:
    p = "warm"
    s = r.section(raw, p, ("cache_dir", "prewarm", "prewarm_readers", "prewarm_headroom"))
    return WarmConfig(
        cache_dir=r.get(s, p, "cache_dir", _opt_string, None) or default_cache_dir(state_dir),
        prewarm=r.get(s, p, "prewarm", _prewarm, "off"),
        prewarm_readers=r.get(s, p, "prewarm_readers", _int_in(1, 64), 4),
        prewarm_headroom=r.get(s, p, "prewarm_headroom", parse_size, None),
    )


def _incidents(r: _Reader, raw: object, state_dir: str) -> IncidentsConfig:
    p = "incidents"
    s = r.section(raw, p, ("dir", "keep", "dump_timeout", "max_bytes", "min_free_bytes"))
    return IncidentsConfig(
        dir=r.get(s, p, "dir", _opt_string, None) or os.path.join(state_dir, "incidents"),
        keep=r.get(s, p, "keep", _int_in(1, 10_000), 20),
        dump_timeout=r.get(s, p, "dump_timeout", _positive_duration, 10.0),
        max_bytes=r.get(s, p, "max_bytes", parse_size, INCIDENTS_MAX_BYTES),
        min_free_bytes=r.get(s, p, "min_free_bytes", parse_size, INCIDENTS_MIN_FREE),
    )


def _router(r: _Reader, raw: object, sglang: SGLangConfig) -> RouterConfig:
    p = "router"
    s = r.section(raw, p, ("url", "worker_url", "api_key_file", "drain_timeout"))
    url = r.get(s, p, "url", _opt_http_url, None)
    worker_url = r.get(s, p, "worker_url", _opt_http_url, None)
    if worker_url is None and sglang.host and sglang.port:
        host = sglang.host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname() if url and not is_loopback_url(url) else "127.0.0.1"
        worker_url = (
            f"http://[{host}]:{sglang.port}" if ":" in host else f"http://{host}:{sglang.port}"
        )
    return RouterConfig(
        url=url,
        worker_url=worker_url or "",
        api_key_file=r.get(s, p, "api_key_file", _opt_readable_file, None),
        drain_timeout=r.get(s, p, "drain_timeout", parse_duration, 30.0),
    )


def _canary_prompt(value: object) -> str:
    if value is None:
        return DEFAULT_CANARY_PROMPT
    text = _string(value)
    if not text.strip():
        raise ValueError("must not be empty (null: the default prompt)")
    return text


def _quality(r: _Reader, raw: object) -> QualityConfig:
    p = "quality"
    s = r.section(raw, p, ("canary", "spec_accept_floor", "on_spec_collapse"))
    cp = f"{p}.canary"
    cs = r.section(s.get("canary"), cp, ("enabled", "prompt", "max_tokens", "policy", "interval"))
    d = CanaryConfig()
    canary = CanaryConfig(
        enabled=r.get(cs, cp, "enabled", _bool, d.enabled),
        prompt=r.get(cs, cp, "prompt", _canary_prompt, d.prompt),
        # At least 2: one token is a prefill, not a decode.
        max_tokens=r.get(cs, cp, "max_tokens", _int_in(2, 256), d.max_tokens),
        policy=r.get(cs, cp, "policy", _choice(*CANARY_POLICIES), d.policy),
        interval=r.get(cs, cp, "interval", _positive_duration, d.interval),
    )
    q = QualityConfig()
    return QualityConfig(
        canary=canary,
        spec_accept_floor=r.get(s, p, "spec_accept_floor", _floor, q.spec_accept_floor),
        on_spec_collapse=r.get(
            s, p, "on_spec_collapse", _choice(*SPEC_COLLAPSE_ACTIONS), q.on_spec_collapse
        ),
    )


def _arg_int(args: Mapping[str, ArgValue], *names: str) -> int | None:
    """The first of `names` in SGLang's args given as a whole number (int or digits)."""
    for name in names:
        value = args.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.isdigit():
            return int(value)
    return None


def tp_size(args: Mapping[str, ArgValue]) -> int | None:
    return _arg_int(args, *TP_ARGS)


def _group(r: _Reader, raw: object, cfg: Config) -> GroupConfig:
    """`group:` plus the role read from SGLang's own multi-node flags."""
    p = "group"
    s = r.section(
        raw,
        p,
        ("peers", "leader", "token_file", "poll_interval", "poll_timeout", "partition_timeout"),
    )
    args = cfg.sglang.args
    nnodes = _arg_int(args, "nnodes") or 1
    rank = _arg_int(args, "node-rank", "node_rank") or 0
    role = "single" if nnodes <= 1 else ("leader" if rank == 0 else "follower")
    peers = r.get(
        s, p, "peers", lambda v: tuple(_http_url(_env_filled(u)) for u in _string_list(v)), ()
    )
    leader = r.get(s, p, "leader", lambda v: _http_url(_env_filled(_string(v))), None)
    if role == "follower" and leader is not None:
        if peers and tuple(peers) != (leader,):
            r.error(f"{p}.leader", f"{leader} differs from group.peers {list(peers)}")
        peers = (leader,)
    out = GroupConfig(
        role=role,
        nnodes=nnodes,
        node_rank=rank,
        peers=peers or (),
        leader=leader,
        token_file=r.get(s, p, "token_file", _opt_absolute_path, None) or cfg.admin.token_file,
        poll_interval=r.get(s, p, "poll_interval", _positive_duration, 0.5),
        poll_timeout=r.get(s, p, "poll_timeout", _positive_duration, 1.0),
        partition_timeout=r.get(s, p, "partition_timeout", _positive_duration, 10.0),
    )
    if rank >= nnodes:
        r.error("sglang.args", f"node-rank {rank} is not below nnodes {nnodes}")
    if role == "single" and out.peers:
        r.error(f"{p}.peers", "set, but sglang.args.nnodes is not above 1")
    if role == "single" and out.leader:
        r.error(f"{p}.leader", "set, but sglang.args.nnodes is not above 1")
    if role == "follower" and len(out.peers) > 1:
        r.error(f"{p}.peers", "a follower (node-rank >= 1) lists exactly one peer: its leader")
    if role == "leader" and out.peers and len(out.peers) != nnodes - 1:
        r.error(f"{p}.peers", f"the leader lists its {nnodes - 1} followers; got {len(out.peers)}")
    return out
