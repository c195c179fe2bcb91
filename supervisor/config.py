"""Configuration: one YAML file parsed once into frozen, typed objects.

Every problem is collected (not just the first), and each names the file, the key path and the
line, so an operator fixes a broken config in one pass. Nothing after `load()` reads raw dicts.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import socket
import stat
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import yaml

DEFAULT_CONFIG_PATH = "/etc/kimi-serve/kimi-serve.yaml"
CONFIG_ENV = "KIMI_SERVE_CONFIG"
PRIMARY = "primary"

ArgScalar = str | int | float | bool | None
ArgValue = ArgScalar | tuple[ArgScalar, ...]

# Flags kimi-serve sets itself from top-level keys; allowing them in `args` too would make the
# command line ambiguous (argparse keeps the last one, silently).
# SGLang's parser also takes `--model` for --model-path.
RESERVED_ARGS = {
    "model-path": "sglang.model_path",
    "model": "sglang.model_path",
    "host": "sglang.host",
    "port": "sglang.port",
}
TP_ARGS = ("tp-size", "tensor-parallel-size", "tp")
RESTART_MODES = ("relaunch", "exit")
# `${NAME}` in a string value of sglang.args / profiles.*.args, group.peers and group.leader:
# filled in from the daemon's environment when the file is read, so one file serves every node
# of a multi-node replica (a LeaderWorkerSet gives each pod LWS_WORKER_INDEX and
# LWS_LEADER_ADDRESS).
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


# --------------------------------------------------------------------------------------------
# The typed result
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """An overlay on `sglang.args` / `sglang.env`; a None value removes the key."""

    name: str
    args: Mapping[str, ArgValue] = field(default_factory=dict)
    env: Mapping[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class SGLangConfig:
    python: str
    module: str
    model_path: str
    host: str
    port: int
    args: Mapping[str, ArgValue]
    env: Mapping[str, str]
    workdir: str | None
    # SGLang's --api-key, from a file; handed over in <state_dir>/sglang-secrets.yaml, never
    # on the command line (supervisor/sglang_key.py).
    api_key_file: str | None = None


@dataclass(frozen=True)
class ProbeConfig:
    endpoint: str  # "generate" | "chat"
    prompt: str
    max_tokens: int
    timeout: float
    expect_regex: str | None


@dataclass(frozen=True)
class ReadinessConfig:
    load_timeout: float
    probe: ProbeConfig


@dataclass(frozen=True)
class LivenessConfig:
    interval: float
    timeout: float
    failure_threshold: int


@dataclass(frozen=True)
class CrashLoopConfig:
    max_restarts: int
    window: float


@dataclass(frozen=True)
class RestartConfig:
    backoff_initial: float
    backoff_max: float
    crash_loop: CrashLoopConfig
    fallback_profile: str | None
    # After this long in `ready`, the backoff starts again from backoff_initial.
    stable_after: float
    # "relaunch": kimi-serve relaunches SGLang itself. "exit": where it would relaunch after a
    # restart nobody asked for, it cleans up and exits EX_RESTART_BY_ORCHESTRATOR instead, so an
    # orchestrator relaunches the whole group (a node of a multi-node replica cannot rejoin).
    mode: str = "relaunch"


@dataclass(frozen=True)
class StopConfig:
    drain_timeout: float


@dataclass(frozen=True)
class GpusConfig:
    manage: bool
    devices: str | tuple[int | str, ...]  # "all" or indexes / UUIDs
    leftover_policy: str  # "kill-matching" | "report-only"
    match: tuple[str, ...]
    memory_free_timeout: float
    memory_free_threshold_mib: int


@dataclass(frozen=True)
class AdminConfig:
    host: str
    port: int
    # Bearer token for the mutating endpoints; default <state_dir>/admin.token (docs/security.md).
    token_file: str = ""
    # Serving the endpoint beyond loopback must be asked for (admin.allow_remote).
    allow_remote: bool = False

    @property
    def listen(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class LogsConfig:
    fatal_patterns: tuple[str, ...]
    tail_lines: int


# 20 incidents of a tp=8 server with native stacks, estimated at up to 5 MiB each
# (docs/incidents.md): 256 MiB holds them with room, and is small beside the journal on /var.
# 1 GiB free is what journald, package upgrades and the launch record need to keep working
# after a burst.
INCIDENTS_MAX_BYTES = 256 * 2**20
INCIDENTS_MIN_FREE = 2**30


@dataclass(frozen=True)
class IncidentsConfig:
    dir: str  # default <state_dir>/incidents
    keep: int  # newest N kept
    dump_timeout: float  # budget for stack dumps of a live, broken SGLang before the kill
    # Bounds, so evidence never costs the host its disk: the incidents together stay under
    # max_bytes (oldest removed first), and nothing large is written while the filesystem has
    # less than min_free_bytes free (see docs/incidents.md).
    max_bytes: int
    min_free_bytes: int


@dataclass(frozen=True)
class LoggingConfig:
    format: str  # "json" | "console"
    level: str


@dataclass(frozen=True)
class RouterConfig:
    """Registration with an sglang-router / SMG in front of a fleet (docs/fleet.md)."""

    url: str | None = None  # the router's own HTTP API; None: no registration
    worker_url: str = ""  # how the router reaches this SGLang (resolved, never empty when url)
    api_key_file: str | None = None
    drain_timeout: float = 30.0

    @property
    def enabled(self) -> bool:
        return self.url is not None


@dataclass(frozen=True)
class GroupConfig:
    """A replica that spans nodes (docs/multinode.md). The role comes from `sglang.args`
    (`nnodes`, `node-rank`): rank 0 leads, ranks >= 1 follow; one node is `single`."""

    role: str = "single"  # "single" | "leader" | "follower"
    nnodes: int = 1
    node_rank: int = 0
    # The peers' admin endpoints: the leader lists its followers, a follower its leader.
    peers: tuple[str, ...] = ()
    # The leader's admin endpoint (`group.leader`): fills a follower's `peers`; the leader
    # itself reads it as its own address. One file for every node (a LeaderWorkerSet).
    leader: str | None = None
    # The bearer token presented to the peers (the same token as their admin.token_file).
    token_file: str = ""
    poll_interval: float = 0.5
    poll_timeout: float = 1.0
    # A peer unreachable this long ends this node's launch (never a relaunch alone).
    partition_timeout: float = 10.0

    @property
    def coordinated(self) -> bool:
        """Relaunches are coordinated over the admin endpoints (bare metal)."""
        return self.role != "single" and bool(self.peers)

    @property
    def answers(self) -> bool:
        """This node takes part in the group protocol: it polls peers, or it is a leader,
        which answers its followers' polls (GET /group) even when it lists none."""
        return self.coordinated or self.role == "leader"


# The canary's default prompt: short, plain text any base or chat model continues confidently.
DEFAULT_CANARY_PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
CANARY_POLICIES = ("gate", "alert")
SPEC_COLLAPSE_ACTIONS = ("alert", "fallback")


@dataclass(frozen=True)
class CanaryConfig:
    enabled: bool = True
    prompt: str = DEFAULT_CANARY_PROMPT
    max_tokens: int = 16
    policy: str = "gate"  # gate | alert
    interval: float = 600.0


@dataclass(frozen=True)
class QualityConfig:
    """Serving quality (docs/quality.md): the canary, speculation's accept length."""

    canary: CanaryConfig = CanaryConfig()
    spec_accept_floor: float = 1.3
    on_spec_collapse: str = "alert"  # alert | fallback


@dataclass(frozen=True)
class WarmConfig:
    """What makes a relaunch cheaper: the compile caches' root and the page-cache prewarm
    (supervisor/caches.py, supervisor/prewarm.py; docs/benchmarks.md has the measurements)."""

    cache_dir: str  # default $CACHE_DIRECTORY (systemd's CacheDirectory=), else <state_dir>/cache
    prewarm: str = "off"  # "auto" | "off"
    prewarm_readers: int = 4
    prewarm_headroom: int | None = None  # bytes kept free; None: 10% of MemTotal, at least 2 GiB


@dataclass(frozen=True)
class Config:
    path: str
    sglang: SGLangConfig
    profiles: Mapping[str, Profile]
    readiness: ReadinessConfig
    liveness: LivenessConfig
    restart: RestartConfig
    stop: StopConfig
    gpus: GpusConfig
    admin: AdminConfig
    state_dir: str
    logs: LogsConfig
    logging: LoggingConfig
    incidents: IncidentsConfig = field(
        default_factory=lambda: IncidentsConfig(
            "/var/lib/kimi-serve/incidents", 20, 10.0, INCIDENTS_MAX_BYTES, INCIDENTS_MIN_FREE
        )
    )
    router: RouterConfig = RouterConfig()
    group: GroupConfig = GroupConfig()
    warm: WarmConfig = WarmConfig("/var/cache/kimi-serve")
    quality: QualityConfig = QualityConfig()
    # The line of every key in the file ("sglang.args.tp-size" -> 5), for errors found after
    # parsing (SGLang's own parser rejecting a flag). Not part of what a reload compares.
    key_lines: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)

    def profile(self, name: str) -> Profile:
        if name == PRIMARY:
            return Profile(PRIMARY)
        return self.profiles[name]

    @property
    def profile_names(self) -> tuple[str, ...]:
        return (PRIMARY, *self.profiles)


# Log lines that mean the server is broken even if its process is still up. SGLang spends ~65 s
# in py-spy / CUDA-coredump steps after a scheduler exception before it exits
# (docs/sglang.md, "Shutdown"), so reacting to the line itself saves a minute per crash.
DEFAULT_FATAL_PATTERNS: tuple[str, ...] = (
    # scheduler.py / detokenizer: `logger.error(f"Scheduler hit an exception: {traceback}")`,
    # then SIGQUIT to the parent. A bare "Traceback" is not listed: a rejected client request
    # can log one without the server being broken.
    r"(Scheduler|DetokenizerManager|TokenizerManager) hit an exception",
    r"Scheduler watchdog timeout",
    r"CUDA out of memory|torch\.OutOfMemoryError|CUDA error: out of memory",
    r"CUDA error: an illegal memory access",
    r"NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError",
    r"Initialization failed\. warmup error",
)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigIssue:
    path: str
    line: int | None
    message: str


class ConfigError(Exception):
    """A config that cannot be used; carries every issue found."""

    def __init__(self, file: str, issues: list[ConfigIssue]) -> None:
        self.file = file
        self.issues = issues
        super().__init__(self.render())

    def render(self) -> str:
        lines = []
        for issue in self.issues:
            where = f"{self.file}:{issue.line}" if issue.line else self.file
            key = f" {issue.path}:" if issue.path else ""
            lines.append(f"{where}:{key} {issue.message}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Scalars
# --------------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object) -> float:
    """`500ms`, `30s`, `5m`, `1h` or a number of seconds -> seconds. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, 5m, 1h or 500ms, got a boolean")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            raise ValueError("is too long for a duration") from None
        if seconds < 0:
            raise ValueError(f"{value!r} is negative; a duration is 0 or more")
    elif isinstance(value, str):
        m = _DURATION.match(value)
        if not m:
            raise ValueError(
                f"{value!r} is not a duration; write it as 500ms, 30s, 5m, 1h or seconds"
            )
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    else:
        raise ValueError(f"expected a duration such as 30s, got {type(value).__name__}")
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is too long for a duration")
    return seconds


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$")
_UNIT_BYTES = {
    None: 1,
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


def parse_size(value: object) -> int:
    """`512MiB`, `1GiB`, `100MB` or a number of bytes -> bytes. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 256MiB or 1GiB, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative; a size is 0 or more")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(float(m.group(1)) * _UNIT_BYTES[m.group(2)])
    raise ValueError(f"{value!r} is not a size; write it as 256MiB, 1GiB, 100MB or bytes")


def parse_listen(value: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port). Raises ValueError."""
    m = re.match(r"^\[(?P<h6>[^\]]+)\]:(?P<p6>\d+)$|^(?P<h>[^:\[\]]+):(?P<p>\d+)$", value)
    if not m:
        raise ValueError(f"{value!r} is not host:port (e.g. 127.0.0.1:29400 or [::1]:29400)")
    host = m.group("h6") or m.group("h")
    port = int(m.group("p6") or m.group("p"))
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range 1-65535")
    return host, port


# --------------------------------------------------------------------------------------------
# The reader: walks the raw YAML with the key path and line of every value at hand
# --------------------------------------------------------------------------------------------

T = TypeVar("T")
_MISSING = object()


class _Reader:
    def __init__(self, file: str, marks: dict[str, int]) -> None:
        self.file = file
        self.marks = marks
        self.issues: list[ConfigIssue] = []

    def line(self, path: str) -> int | None:
        # The value's own line, else the closest enclosing key's.
        while path not in self.marks:
            path = path.rpartition(".")[0]
            if not path:
                return None  # a missing top-level key: no line to point at
        return self.marks[path]

    def error(self, path: str, message: str) -> None:
        self.issues.append(ConfigIssue(path, self.line(path), message))

    def section(self, raw: object, path: str, known: tuple[str, ...]) -> dict[str, Any]:
        """A mapping whose keys must all be known; unknown keys get a did-you-mean hint."""
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            what = "" if path else "the top level: "
            self.error(path, f"{what}expected a mapping of {', '.join(known)}; got {_kind(raw)}")
            return {}
        for key in raw:
            if not isinstance(key, str):
                self.error(path, f"key {key!r} is not a string")
            elif key not in known:
                sub = f"{path}.{key}" if path else key
                close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self.error(sub, f"unknown key {key!r}{hint} (known: {', '.join(known)})")
        return raw

    def get(
        self,
        raw: dict[str, Any],
        path: str,
        key: str,
        conv: Callable[[object], T],
        default: object = _MISSING,
    ) -> T:
        sub = f"{path}.{key}" if path else key
        if key not in raw:
            if default is _MISSING:
                self.error(sub, "is required but missing")
                return None  # type: ignore[return-value]
            return default  # type: ignore[return-value]
        try:
            return conv(raw[key])
        except (TypeError, ValueError) as exc:
            self.error(sub, str(exc))
            return None  # type: ignore[return-value]


def _kind(value: object) -> str:
    if value is None:
        return "nothing (null)"
    kinds = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}
    kinds |= {int: "an integer", float: "a number"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _string(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {_kind(value)}")
    return value


def _opt_string(value: object) -> str | None:
    return None if value is None else _string(value)


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_kind(value)}")
    return value


def _int_in(lo: int, hi: int | None = None) -> Callable[[object], int]:
    def conv(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected a whole number, got {_kind(value)}")
        if value < lo or (hi is not None and value > hi):
            rng = f"{lo}-{hi}" if hi is not None else f">= {lo}"
            raise ValueError(f"{value} is out of range {rng}")
        return value

    return conv


def _positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"must be greater than zero, got {value!r}")
    return seconds


def _choice(*choices: str) -> Callable[[object], str]:
    def conv(value: object) -> str:
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}{hint}")
        return str(value)

    return conv


def _regex(value: object) -> str:
    text = _string(value)
    try:
        re.compile(text)
    except re.error as exc:
        raise ValueError(f"{text!r} is not a valid regular expression: {exc}") from None
    return text


def _opt_regex(value: object) -> str | None:
    return None if value is None else _regex(value)


def _string_list(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"expected a list of strings, got {_kind(value)}")
    return tuple(value)


def _regex_list(value: object) -> tuple[str, ...]:
    return tuple(_regex(v) for v in _string_list(value))


def _host(value: object) -> str:
    text = _string(value)
    if any(c.isspace() for c in text) or "/" in text:
        raise ValueError(f"{text!r} is not a host name or address")
    return text


# --------------------------------------------------------------------------------------------
# Sections
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
            out[key] = tuple(_expand_env(r, sub, v) for v in value)
        elif isinstance(value, str):
            out[key] = _expand_env(r, sub, value)
        elif value is None or isinstance(value, int | float | bool):
            out[key] = value
        else:
            # A date, a mapping, !!binary ...: str() of it is not what SGLang expects.
            r.error(sub, f"expected a string, number, boolean, list or null; got {_kind(value)}")
    return out


def _expand_env(r: _Reader, path: str, value: T) -> T:
    """`${NAME}` in a string replaced by the variable's value; unset or empty is an error."""
    if not isinstance(value, str) or "${" not in value:
        return value

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        got = os.environ.get(name)
        if not got:
            how = "is empty" if got == "" else "is not set"
            r.error(path, f"{value!r} needs the environment variable {name}, which {how}")
            return m.group(0)
        return got

    return _ENV_REF.sub(one, value)  # type: ignore[return-value]


def _env_filled(text: str) -> str:
    """`${NAME}` in a group URL filled in from the environment (as in sglang.args)."""

    def one(m: re.Match[str]) -> str:
        got = os.environ.get(m.group(1))
        if not got:
            how = "is empty" if got == "" else "is not set"
            raise ValueError(f"{text!r} needs the environment variable {m.group(1)}, which {how}")
        return got

    return _ENV_REF.sub(one, text)


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


def _devices(value: object) -> str | tuple[int | str, ...]:
    if value == "all":
        return "all"
    if isinstance(value, list) and value:
        out: list[int | str] = []
        for v in value:
            index = isinstance(v, int) and not isinstance(v, bool) and v >= 0
            if index or (isinstance(v, str) and v.startswith(("GPU-", "MIG-"))):
                out.append(v)
            else:
                raise ValueError(
                    f"device {v!r} is neither an index (0, 1, ...) nor a UUID (GPU-...)"
                )
        if len(set(out)) != len(out):
            raise ValueError("the device list names a GPU twice")
        return tuple(out)
    raise ValueError(f"expected 'all' or a non-empty list of indexes/UUIDs, got {_kind(value)}")


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


def _opt_absolute_path(value: object) -> str | None:
    if value is None:
        return None
    text = _string(value)
    if not os.path.isabs(text):
        raise ValueError(f"{text!r} is not an absolute path")
    return text


def default_token_file(state_dir: str) -> str:
    # The state directory, not $RUNTIME_DIRECTORY: the CLI (outside the unit) finds it from the
    # same config, and the token survives daemon restarts, so a copy held by a proxy or a peer
    # stays valid (docs/security.md).
    return os.path.join(state_dir or default_state_dir(), "admin.token")


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address; a name other than localhost counts as remote."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def _prewarm(value: object) -> str:
    # YAML 1.1 reads a bare `off` as false.
    return "off" if value is False else _choice("auto", "off")(value)


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


_LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::", "")


def _http_url(value: object) -> str:
    text = _string(value).strip()
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{text!r} is not an http:// or https:// URL")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{text!r} has an invalid port") from None
    if not parts.hostname or (port is not None and not 1 <= port <= 65535):
        raise ValueError(f"{text!r} names no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{text!r} must be scheme://host:port only, without a path")
    return text.rstrip("/")


def _opt_http_url(value: object) -> str | None:
    return None if value is None else _http_url(value)


def _readable_file(value: object) -> str:
    text = _string(value)
    try:
        with open(text, "rb"):
            pass
    except FileNotFoundError:
        raise ValueError(f"{text!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{text!r} is a directory, not a file") from None
    except PermissionError:
        raise ValueError(f"{text!r} is not readable by this user") from None
    except OSError as exc:
        raise ValueError(f"{text!r} cannot be read: {exc.strerror}") from None
    return text


def key_file_problem(st: os.stat_result) -> str:
    """Why a file holding a secret may leak or be swapped; "" when its mode is fine."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o007:
        return f"is mode {mode:04o}: others may read or write it (0600, 0400 or 0440 is required)"
    if mode & 0o020:
        return f"is mode {mode:04o}: its group may write it (0600, 0400 or 0440 is required)"
    return ""


def _opt_key_file(value: object) -> str | None:
    if value is None:
        return None
    text = _readable_file(value)
    if not os.path.isabs(text):
        raise ValueError(f"{text!r} must be an absolute path")
    problem = key_file_problem(os.stat(text))
    if problem:
        raise ValueError(f"{text!r} {problem}")
    return text


def _opt_readable_file(value: object) -> str | None:
    return None if value is None else _readable_file(value)


def is_loopback_url(url: str) -> bool:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


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


def _floor(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"expected a number, got {_kind(value)}")
    if not 1.0 <= value <= 64.0:
        raise ValueError(f"{value} is out of range 1-64 (a mean accept length, in tokens)")
    return float(value)


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


def warnings(cfg: Config) -> list[str]:
    """Problems that do not stop the daemon but are very likely mistakes (`check` prints them)."""
    out: list[str] = []
    g = cfg.group
    if g.role != "single" and not g.peers and cfg.restart.mode != "exit":
        out.append(
            f"group: this node is the {g.role} of a multi-node replica (sglang.args.nnodes "
            f"{g.nnodes}) with neither group.peers (bare metal) nor restart.mode: exit (an "
            "orchestrator): it would relaunch alone, and a node cannot rejoin a running group"
        )
    rc = cfg.router
    if rc.url is not None:
        if is_loopback_url(rc.worker_url) and not is_loopback_url(rc.url):
            out.append(
                f"router.worker_url: {rc.worker_url} is a loopback address but the router at "
                f"{rc.url} runs on another host: it cannot reach this SGLang; set "
                "router.worker_url to an address the router can reach"
            )
        if not cfg.sglang.args.get("enable-metrics"):
            out.append(
                "router: sglang.args.enable-metrics is not set: a drain cannot see SGLang's "
                "running and queued requests and ends without waiting for them"
            )
    return out


TOP_KEYS = (
    "sglang",
    "profiles",
    "readiness",
    "liveness",
    "restart",
    "stop",
    "gpus",
    "admin",
    "state_dir",
    "logs",
    "logging",
    "incidents",
    "router",
    "group",
    "warm",
    "quality",
)


def tp_size(args: Mapping[str, ArgValue]) -> int | None:
    return _arg_int(args, *TP_ARGS)


def default_state_dir() -> str:
    # systemd's StateDirectory= exports STATE_DIRECTORY (possibly several, colon-separated).
    env = os.environ.get("STATE_DIRECTORY")
    return env.split(":")[0] if env else "/var/lib/kimi-serve"


def _affects(issue: str, key: str) -> bool:
    """Whether an issue at path `issue` leaves `key` unread: the key itself, a part of it, or
    a section around it (the top level included)."""
    return (
        not issue
        or issue == key
        or issue.startswith((f"{key}.", f"{key}["))
        or key.startswith(f"{issue}.")
    )


def _cross_checks(r: _Reader, cfg: Config) -> None:
    """Checks across keys, each made only when every key it reads parsed: a key that did not
    parse reads None or its default here, which would give a wrong error, a crash, or none."""
    issues = [i.path for i in r.issues]

    def parsed(*keys: str) -> bool:
        return not any(_affects(i, k) for i in issues for k in keys)

    fb = cfg.restart.fallback_profile if parsed("restart.fallback_profile") else None
    # The profile names are known unless the profiles section, or that profile's name, was bad.
    names_known = not any(i in ("", "profiles", f"profiles.{fb}") for i in issues)
    if fb is not None and fb != PRIMARY and names_known and fb not in cfg.profiles:
        names = ", ".join(cfg.profiles) or "none defined"
        r.error(
            "restart.fallback_profile",
            f"names profile {fb!r}, which is not defined under profiles ({names})",
        )
    if fb == PRIMARY:
        r.error("restart.fallback_profile", "the fallback cannot be 'primary' itself")
    if (
        parsed("quality.on_spec_collapse", "restart.fallback_profile")
        and cfg.quality.on_spec_collapse == "fallback"
        and cfg.restart.fallback_profile is None
    ):
        r.error(
            "quality.on_spec_collapse",
            "is 'fallback' but no restart.fallback_profile is set to fall back to",
        )
    backoff = parsed("restart.backoff_max", "restart.backoff_initial")
    if backoff and cfg.restart.backoff_max < cfg.restart.backoff_initial:
        r.error("restart.backoff_max", "must be at least restart.backoff_initial")
    timing = parsed("liveness.timeout", "liveness.interval")
    if timing and cfg.liveness.timeout > cfg.liveness.interval * 10:
        r.error("liveness.timeout", "is more than ten liveness intervals; shorten it")
    listen = parsed("admin.listen")
    if (
        listen
        and parsed("sglang.host", "sglang.port")
        and (cfg.admin.host, cfg.admin.port) == (cfg.sglang.host, cfg.sglang.port)
    ):
        r.error("admin.listen", "uses the same address as SGLang's sglang.host:sglang.port")
    remote = parsed("admin.allow_remote")
    if listen and remote and not is_loopback(cfg.admin.host) and not cfg.admin.allow_remote:
        r.error(
            "admin.listen",
            f"{cfg.admin.listen} is not a loopback address: anyone who can reach it may try "
            "the token of the restart and drain endpoints; put a TLS proxy in front and set "
            "admin.allow_remote: true to serve it beyond this host (docs/security.md)",
        )
    if isinstance(cfg.gpus.devices, tuple) and parsed("gpus.devices", "sglang.args", "profiles"):
        for name in (PRIMARY, *cfg.profiles):
            own = cfg.sglang.args if name == PRIMARY else cfg.profiles[name].args
            flag = next((a for a in TP_ARGS if a in own), None)
            if flag is None:
                continue  # a profile that leaves the size alone repeats the primary's
            merged = {**cfg.sglang.args, **own}
            tp = tp_size(merged)
            if tp is not None and tp > len(cfg.gpus.devices):
                where = "sglang.args" if name == PRIMARY else f"profiles.{name}.args"
                r.error(
                    f"{where}.{flag}",
                    f"{flag} {tp} needs {tp} GPUs but gpus.devices lists {len(cfg.gpus.devices)}",
                )


def _marks(root: yaml.Node | None) -> tuple[dict[str, int], list[ConfigIssue]]:
    """The line of every key path, and the keys written twice in one mapping (PyYAML keeps
    the last silently, so a second `port:` further down would quietly win)."""
    marks: dict[str, int] = {}
    twice: list[ConfigIssue] = []
    seen: set[int] = set()

    def walk(node: yaml.Node, path: str) -> None:
        # An alias is the same node again: walk it once (a recursive or exponential
        # alias would otherwise never finish).
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                key = str(key_node.value)
                sub = f"{path}.{key}" if path else key
                line = key_node.start_mark.line + 1
                ident = (key_node.tag, key)
                if ident in first and key_node.tag != "tag:yaml.org,2002:merge":
                    twice.append(
                        ConfigIssue(sub, line, f"is set twice (first on line {first[ident]})")
                    )
                first.setdefault(ident, line)
                marks[sub] = line
                walk(value_node, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                sub = f"{path}[{i}]"
                marks[sub] = item.start_mark.line + 1
                walk(item, sub)

    if root is not None:
        marks[""] = root.start_mark.line + 1
        walk(root, "")
    return marks, twice


def _yaml_issue(exc: yaml.YAMLError, text: str) -> ConfigIssue:
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    if isinstance(exc, yaml.reader.ReaderError):  # a control character: it has a position only
        line = text.count("\n", 0, exc.position) + 1
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    # An unclosed quote or bracket is found only at the end of the file; where it was opened
    # is the line to fix.
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and start is not None and start.line + 1 != line:
        problem = f"{context} (line {start.line + 1}): {problem}"
    return ConfigIssue("", line, f"invalid YAML: {problem}")


def parse(text: str, file: str) -> Config:
    """Parse YAML text into a Config, or raise ConfigError listing every problem."""
    try:
        raw = yaml.safe_load(text)
        marks, twice = _marks(yaml.compose(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as exc:
        raise ConfigError(file, [_yaml_issue(exc, text)]) from None
    except RecursionError:
        raise ConfigError(
            file, [ConfigIssue("", None, "invalid YAML: nested too deeply")]
        ) from None
    r = _Reader(file, marks)
    r.issues.extend(twice)
    if raw is None:
        raise ConfigError(file, [ConfigIssue("", None, "the file is empty")])
    top = r.section(raw, "", TOP_KEYS)
    if not isinstance(raw, dict):
        raise ConfigError(file, r.issues)
    stop_s = r.section(top.get("stop"), "stop", ("drain_timeout",))
    state_dir = r.get(top, "", "state_dir", _opt_string, None) or default_state_dir()
    sglang = _sglang(r, top.get("sglang"))
    cfg = Config(
        path=file,
        sglang=sglang,
        profiles=_profiles(r, top.get("profiles")),
        readiness=_readiness(r, top.get("readiness")),
        liveness=_liveness(r, top.get("liveness")),
        restart=_restart(r, top.get("restart")),
        stop=StopConfig(r.get(stop_s, "stop", "drain_timeout", _positive_duration, 60.0)),
        gpus=_gpus(r, top.get("gpus")),
        admin=_admin(r, top.get("admin"), state_dir),
        state_dir=state_dir,
        logs=_logs(r, top.get("logs")),
        logging=_logging(r, top.get("logging")),
        incidents=_incidents(r, top.get("incidents"), state_dir),
        router=_router(r, top.get("router"), sglang),
        warm=_warm(r, top.get("warm"), state_dir),
        quality=_quality(r, top.get("quality")),
        key_lines=marks,
    )
    cfg = replace(cfg, group=_group(r, top.get("group"), cfg))
    restart_raw = top.get("restart")
    if (
        not (isinstance(restart_raw, dict) and "fallback_profile" in restart_raw)
        and "fallback" in cfg.profiles
    ):
        # Unset: a profile named `fallback` is the fallback (the contract's example); without
        # one a crash loop ends in `failed`. An explicit null always means `failed`.
        cfg = replace(cfg, restart=replace(cfg.restart, fallback_profile="fallback"))
    _cross_checks(r, cfg)
    if r.issues:
        raise ConfigError(file, r.issues)
    return cfg


def resolve_path(cli_value: str | None) -> str:
    return cli_value or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH


def load(path: str) -> Config:
    """Read and parse the config file; every failure is a ConfigError naming the file."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        hint = f" (set --config or ${CONFIG_ENV})" if path == DEFAULT_CONFIG_PATH else ""
        raise ConfigError(path, [ConfigIssue("", None, f"no such file{hint}")]) from None
    except IsADirectoryError:
        raise ConfigError(path, [ConfigIssue("", None, "is a directory, not a file")]) from None
    except PermissionError:
        raise ConfigError(
            path, [ConfigIssue("", None, "permission denied: the daemon cannot read it")]
        ) from None
    except OSError as exc:
        raise ConfigError(path, [ConfigIssue("", None, f"cannot read: {exc.strerror}")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        issue = ConfigIssue("", line, f"not UTF-8 text: byte {data[exc.start]:#04x} ({exc.reason})")
        raise ConfigError(path, [issue]) from None
    return parse(text, path)
