"""Configuration, the typed result: the frozen dataclass of every section, the names kimi-serve
reserves in SGLang's args, and the errors a config read raises. A field's default, where it has
one, is the key's declared default (`settings`).

`supervisor.config` parses a file into these; every name here is importable from there too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from supervisor.config.errors import ConfigError as ConfigError
from supervisor.config.errors import ConfigIssue as ConfigIssue
from supervisor.config.settings import CANARY_POLICIES as CANARY_POLICIES
from supervisor.config.settings import DEFAULT_CANARY_PROMPT as DEFAULT_CANARY_PROMPT
from supervisor.config.settings import DEFAULT_FATAL_PATTERNS as DEFAULT_FATAL_PATTERNS
from supervisor.config.settings import FALLBACK_STATE_DIR, default
from supervisor.config.settings import RESTART_MODES as RESTART_MODES
from supervisor.config.settings import SPEC_COLLAPSE_ACTIONS as SPEC_COLLAPSE_ACTIONS

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
    # on the command line (supervisor/sglang/api_key.py).
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
    mode: str = default("restart.mode")


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
    allow_remote: bool = default("admin.allow_remote")

    @property
    def listen(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class LogsConfig:
    fatal_patterns: tuple[str, ...]
    tail_lines: int


INCIDENTS_MAX_BYTES: int = default("incidents.max_bytes")
INCIDENTS_MIN_FREE: int = default("incidents.min_free_bytes")


@dataclass(frozen=True)
class IncidentsConfig:
    dir: str  # default <state_dir>/incidents
    keep: int = default("incidents.keep")  # newest N kept
    # budget for stack dumps of a live, broken SGLang before the kill
    dump_timeout: float = default("incidents.dump_timeout")
    # Bounds, so evidence never costs the host its disk: the incidents together stay under
    # max_bytes (oldest removed first), and nothing large is written while the filesystem has
    # less than min_free_bytes free (see docs/incidents.md).
    max_bytes: int = INCIDENTS_MAX_BYTES
    min_free_bytes: int = INCIDENTS_MIN_FREE


@dataclass(frozen=True)
class LoggingConfig:
    format: str  # "json" | "console"
    level: str


@dataclass(frozen=True)
class RouterConfig:
    """Registration with an sglang-router / SMG in front of a fleet (docs/fleet.md)."""

    url: str | None = default("router.url")  # the router's own HTTP API; None: no registration
    worker_url: str = ""  # how the router reaches this SGLang (resolved, never empty when url)
    api_key_file: str | None = default("router.api_key_file")
    drain_timeout: float = default("router.drain_timeout")

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
    peers: tuple[str, ...] = default("group.peers")
    # The leader's admin endpoint (`group.leader`): fills a follower's `peers`; the leader
    # itself reads it as its own address. One file for every node (a LeaderWorkerSet).
    leader: str | None = default("group.leader")
    # The bearer token presented to the peers (the same token as their admin.token_file).
    token_file: str = ""
    poll_interval: float = default("group.poll_interval")
    poll_timeout: float = default("group.poll_timeout")
    # A peer unreachable this long ends this node's launch (never a relaunch alone).
    partition_timeout: float = default("group.partition_timeout")

    @property
    def coordinated(self) -> bool:
        """Relaunches are coordinated over the admin endpoints (bare metal)."""
        return self.role != "single" and bool(self.peers)

    @property
    def answers(self) -> bool:
        """This node takes part in the group protocol: it polls peers, or it is a leader,
        which answers its followers' polls (GET /group) even when it lists none."""
        return self.coordinated or self.role == "leader"


@dataclass(frozen=True)
class CanaryConfig:
    enabled: bool = default("quality.canary.enabled")
    prompt: str = default("quality.canary.prompt")
    max_tokens: int = default("quality.canary.max_tokens")
    policy: str = default("quality.canary.policy")  # gate | alert
    interval: float = default("quality.canary.interval")


@dataclass(frozen=True)
class QualityConfig:
    """Serving quality (docs/quality.md): the canary, speculation's accept length."""

    canary: CanaryConfig = CanaryConfig()
    known_answers: tuple[tuple[str, str], ...] = default("quality.known_answers")
    spec_accept_floor: float = default("quality.spec_accept_floor")
    on_spec_collapse: str = default("quality.on_spec_collapse")  # alert | fallback
    trial_period: float = default("quality.trial_period")
    trial_slowdown: float = default("quality.trial_slowdown")
    trial_accept_drop: float = default("quality.trial_accept_drop")
    on_trial_regression: str = default("quality.on_trial_regression")  # rollback | hold | alert


@dataclass(frozen=True)
class WarmConfig:
    """What makes a relaunch cheaper: the compile caches' root and the page-cache prewarm
    (supervisor/sglang/caches.py, supervisor/warm/prewarm.py; docs/benchmarks.md has the
    measurements)."""

    cache_dir: str  # default $CACHE_DIRECTORY (systemd's CacheDirectory=), else <state_dir>/cache
    prewarm: str = default("warm.prewarm")  # "auto" | "off"
    prewarm_readers: int = default("warm.prewarm_readers")
    # bytes kept free; None: 10% of MemTotal, at least 2 GiB
    prewarm_headroom: int | None = default("warm.prewarm_headroom")


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
    incidents: IncidentsConfig = IncidentsConfig(os.path.join(FALLBACK_STATE_DIR, "incidents"))
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


def merged_args(cfg: Config, profile: str) -> dict[str, ArgValue]:
    """SGLang's flags for `profile`: sglang.args with the profile's overlay on top."""
    args = dict(cfg.sglang.args)
    if profile != PRIMARY:
        for name, value in cfg.profile(profile).args.items():
            # A null in the overlay removes the flag; keeping the key with None keeps the
            # command line identical to "never set" while the position stays stable.
            args[name] = value
    return args


def merged_env(cfg: Config, profile: str) -> dict[str, str]:
    """SGLang's extra environment for `profile` (a null in the overlay removes a variable)."""
    env: dict[str, str | None] = dict(cfg.sglang.env)
    if profile != PRIMARY:
        env.update(cfg.profile(profile).env)
    return {k: v for k, v in env.items() if v is not None}
