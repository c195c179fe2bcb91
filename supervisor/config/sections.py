"""Configuration, one parser per section: raw YAML (through `reader._Reader`) into that
section's frozen dataclass (`types`). The keys a section knows, each value's converter and
default come from the declarations in `settings`; what is here is what a table cannot say:
maps parsed entry by entry (SGLang's args, env, profiles) and defaults resolved from other keys
or the environment.

`supervisor.config.parse` calls them in order; checks across keys are in `checks`.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from supervisor.config import settings
from supervisor.config.convert import _kind, expand_env, is_loopback_url
from supervisor.config.reader import _MISSING, _Reader
from supervisor.config.types import (
    PRIMARY,
    RESERVED_ARGS,
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
    StopConfig,
    WarmConfig,
)

# --------------------------------------------------------------------------------------------
# Reading by the declarations
# --------------------------------------------------------------------------------------------


def _open(r: _Reader, raw: object, path: str, declared: str | None = None) -> dict[str, Any]:
    """The mapping at `path`, its keys checked against those declared for it."""
    return r.section(raw, path, settings.known(path if declared is None else declared))


def _take(r: _Reader, s: dict[str, Any], key: str) -> Any:
    """The value of the declared `key` in its section's mapping `s`: converted, or its default;
    a value that does not convert is an issue (and None)."""
    st = settings.setting(key)
    assert st.conv is not None, f"{key} is parsed by its section"
    return r.get(s, st.section, st.name, st.conv, _MISSING if st.required else st.value)


def _values(r: _Reader, s: dict[str, Any], section: str) -> dict[str, Any]:
    """Every declared key directly in `section` (not its subsections), by name."""
    return {st.name: _take(r, s, st.key) for st in settings.leaves(section)}


def _read(r: _Reader, raw: object, section: str) -> dict[str, Any]:
    """A section without subsections: its keys checked, every value by name."""
    return _values(r, _open(r, raw, section), section)


# --------------------------------------------------------------------------------------------
# The sections
# --------------------------------------------------------------------------------------------


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
    s = _open(r, raw, p)
    if raw is None:
        r.error(p, "is required but missing (at least sglang.model_path)")
    env = _env(r, s.get("env"), f"{p}.env", allow_null=False)
    return SGLangConfig(
        **_values(r, s, p),
        args=_args(r, s.get("args"), f"{p}.args"),
        env={k: v for k, v in env.items() if v is not None},
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
        s = _open(r, body, p, "profiles.NAME")
        out[name] = Profile(
            name=name,
            args=_args(r, s.get("args"), f"{p}.args"),
            env=_env(r, s.get("env"), f"{p}.env", allow_null=True),
        )
    return out


def _readiness(r: _Reader, raw: object) -> ReadinessConfig:
    s = _open(r, raw, "readiness")
    probe = ProbeConfig(**_read(r, s.get("probe"), "readiness.probe"))
    return ReadinessConfig(**_values(r, s, "readiness"), probe=probe)


def _liveness(r: _Reader, raw: object) -> LivenessConfig:
    return LivenessConfig(**_read(r, raw, "liveness"))


def _restart(r: _Reader, raw: object) -> RestartConfig:
    s = _open(r, raw, "restart")
    crash_loop = CrashLoopConfig(**_read(r, s.get("crash_loop"), "restart.crash_loop"))
    return RestartConfig(**_values(r, s, "restart"), crash_loop=crash_loop)


def _stop(r: _Reader, raw: object) -> StopConfig:
    return StopConfig(**_read(r, raw, "stop"))


def _gpus(r: _Reader, raw: object) -> GpusConfig:
    return GpusConfig(**_read(r, raw, "gpus"))


def _admin(r: _Reader, raw: object, state_dir: str) -> AdminConfig:
    v = _read(r, raw, "admin")
    host, port = v.pop("listen") or settings.default("admin.listen")
    return AdminConfig(
        host=host,
        port=port,
        token_file=v.pop("token_file") or default_token_file(state_dir),
        **v,
    )


def default_token_file(state_dir: str) -> str:
    # The state directory, not $RUNTIME_DIRECTORY: the CLI (outside the unit) finds it from the
    # same config, and the token survives daemon restarts, so a copy held by a proxy or a peer
    # stays valid (docs/security.md).
    return os.path.join(state_dir or default_state_dir(), "admin.token")


def default_state_dir() -> str:
    # systemd's StateDirectory= exports STATE_DIRECTORY (possibly several, colon-separated).
    env = os.environ.get("STATE_DIRECTORY")
    return env.split(":")[0] if env else settings.FALLBACK_STATE_DIR


def _logs(r: _Reader, raw: object) -> LogsConfig:
    return LogsConfig(**_read(r, raw, "logs"))


def _logging(r: _Reader, raw: object) -> LoggingConfig:
    return LoggingConfig(**_read(r, raw, "logging"))


def default_cache_dir(state_dir: str) -> str:
    # systemd's CacheDirectory= exports CACHE_DIRECTORY (possibly several, colon-separated).
    env = os.environ.get("CACHE_DIRECTORY")
    return env.split(":")[0] if env else os.path.join(state_dir, "cache")


def _warm(r: _Reader, raw: object, state_dir: str) -> WarmConfig:
    v = _read(r, raw, "warm")
    return WarmConfig(cache_dir=v.pop("cache_dir") or default_cache_dir(state_dir), **v)


def _incidents(r: _Reader, raw: object, state_dir: str) -> IncidentsConfig:
    v = _read(r, raw, "incidents")
    return IncidentsConfig(dir=v.pop("dir") or os.path.join(state_dir, "incidents"), **v)


def _router(r: _Reader, raw: object, sglang: SGLangConfig) -> RouterConfig:
    v = _read(r, raw, "router")
    url, worker_url = v["url"], v.pop("worker_url")
    if worker_url is None and sglang.host and sglang.port:
        host = sglang.host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname() if url and not is_loopback_url(url) else "127.0.0.1"
        worker_url = (
            f"http://[{host}]:{sglang.port}" if ":" in host else f"http://{host}:{sglang.port}"
        )
    return RouterConfig(worker_url=worker_url or "", **v)


def _quality(r: _Reader, raw: object) -> QualityConfig:
    s = _open(r, raw, "quality")
    canary = CanaryConfig(**_read(r, s.get("canary"), "quality.canary"))
    return QualityConfig(canary=canary, **_values(r, s, "quality"))


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
    """`group:` plus the role read from SGLang's own multi-node flags (what a combination of
    them may not be: `checks._group_checks`)."""
    p = "group"
    v = _read(r, raw, p)
    args = cfg.sglang.args
    nnodes = _arg_int(args, "nnodes") or 1
    rank = _arg_int(args, "node-rank", "node_rank") or 0
    role = "single" if nnodes <= 1 else ("leader" if rank == 0 else "follower")
    peers, leader = v.pop("peers"), v["leader"]
    if role == "follower" and leader is not None:
        if peers and tuple(peers) != (leader,):
            r.error(f"{p}.leader", f"{leader} differs from group.peers {list(peers)}")
        peers = (leader,)
    return GroupConfig(
        role=role,
        nnodes=nnodes,
        node_rank=rank,
        peers=peers or (),
        token_file=v.pop("token_file") or cfg.admin.token_file,
        **v,
    )
