"""The machine's vocabulary: the events fed to `machine.Machine.handle()` and the actions it
returns (frozen dataclasses, the `Event` and `Action` unions). No I/O, no decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from supervisor.core.states import ProbeKind, Reason, Regression, State, TimerName, UpgradeState
from supervisor.sglang.probe import ProbeResult, Progress

# ---------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Start:
    pass


@dataclass(frozen=True)
class HostReady:
    """Leftovers removed, GPU memory free, port free."""


@dataclass(frozen=True)
class HostNotReady:
    message: str
    wedged: bool = False  # retrying cannot help (a process stuck in the driver)
    model_missing: bool = False  # a model or draft model path is missing: state `waiting`


@dataclass(frozen=True)
class GpuUnfit:
    """Before a launch: a managed GPU needs a reset, a reboot or a replacement (fitness.py).
    `line` names the GPU, its UUID and the action."""

    line: str


@dataclass(frozen=True)
class GpuFault:
    """While a launch runs: a critical NVML event, with fitness read again. `restart`: the
    GPU is lost or the driver asks for an action; otherwise it is only reported."""

    line: str
    restart: bool


@dataclass(frozen=True)
class Launched:
    launch: int
    pid: int


@dataclass(frozen=True)
class LaunchFailed:
    launch: int
    message: str


@dataclass(frozen=True)
class PortOpen:
    launch: int


@dataclass(frozen=True)
class ReadyLine:
    launch: int


@dataclass(frozen=True)
class FatalLog:
    launch: int
    line: str  # the line that proves it (a traceback's exception line)


@dataclass(frozen=True)
class ProbeDone:
    launch: int
    kind: ProbeKind
    result: ProbeResult
    # SGLang kept working for others meanwhile (its realtime token counter advanced with
    # requests running or queued; probe.is_busy)
    busy: bool = False
    # The canary ran with the probe and differs from the golden answer: expected and got.
    canary_mismatch: str | None = None
    # The canary ran with the probe and got no answer (an error, a timeout): why.
    canary_unavailable: str | None = None
    # SGLang's counters as read beside the probe (probing.decode), for the quality readings;
    # not part of the verdict.
    progress_before: Progress | None = field(default=None, compare=False)
    # The launch's single-stream decode speed and accept length at the gate (readiness, idle,
    # the fixed prompts): what a trial is judged on against the last known good. None: not
    # measured (busy, no canary, no speculation).
    gate_tps: float | None = None
    gate_accept: float | None = None
    # The mismatch is a known answer's (quality.known_answers), not the golden's.
    known_failed: bool = False


@dataclass(frozen=True)
class ChildExited:
    """A process of the launch died: the main process, or (`process` set) one of SGLang's own
    workers (scheduler, detokenizer, resource tracker). Either way the server cannot serve:
    real SGLang's main process notices a dead scheduler only after a 5 s sleep, and its HTTP
    requests hang meanwhile (docs/sglang.md)."""

    launch: int
    exit_code: int | None
    signal: int | None
    process: str = ""  # e.g. "sglang::scheduler (pid 4242)"; "" for the main process


@dataclass(frozen=True)
class ChildGone:
    """Every process of the launch is gone (after StopChild, or after it died by itself)."""

    launch: int
    exit_code: int | None
    signal: int | None
    stuck: tuple[int, ...] = ()  # pids that survive SIGKILL (D state)


@dataclass(frozen=True)
class TimerFired:
    name: TimerName
    launch: int


@dataclass(frozen=True)
class StopRequested:
    signal_name: str = "SIGTERM"


@dataclass(frozen=True)
class RestartRequested:
    reason: Reason  # MANUAL or RELOAD
    back_to_primary: bool = False


@dataclass(frozen=True)
class ReloadRequested:
    """SIGHUP: the config file is to be read again."""


class Verdict(StrEnum):
    INVALID = "invalid"  # the running configuration stays
    UNCHANGED = "unchanged"
    CHANGED = "changed"  # the daemon has already taken the new configuration


@dataclass(frozen=True)
class ConfigRead:
    """The reloaded file, judged (supervisor/daemon/reload.py)."""

    verdict: Verdict


@dataclass(frozen=True)
class DrainRequested:
    """POST /drain: out of the router, SGLang keeps running (state DRAINING)."""


@dataclass(frozen=True)
class UndrainRequested:
    """POST /undrain: back to READY, and so registered again."""


@dataclass(frozen=True)
class SpecCollapsed:
    """Speculative decoding's mean accept length stays below quality.spec_accept_floor
    (quality.SpecWatch); only acted on with quality.on_spec_collapse: fallback."""

    launch: int
    detail: str


@dataclass(frozen=True)
class GroupEnded:
    """The multi-node group's launch (epoch) ended elsewhere or cannot go on: a peer's SGLang
    died, the leader relaunched, or the admin channel is cut (docs/multinode.md). No node of
    a group can rejoin a running one, so this node's launch ends too."""

    launch: int
    detail: str


@dataclass(frozen=True)
class LaunchCompared:
    """The launch against the last known good of its profile (daemon/upgrades.py), before its
    gate: what differs (interpreter, SGLang version, model files, argv, env), in words; () the
    same. `refusal`: why the last known good cannot be relaunched as it was (its interpreter
    or model files changed in place, its configuration has no root-owned source), or None."""

    launch: int
    has_lkg: bool
    differs: tuple[str, ...] = ()
    lkg_tps: float | None = None
    lkg_accept: float | None = None
    refusal: str | None = None


class UpgradeOp(StrEnum):
    ACCEPT = "accept"  # the trial (or the config a rollback left) is taken as the last known good
    ROLLBACK = "rollback"  # relaunch the last known good now


@dataclass(frozen=True)
class UpgradeRequested:
    """POST /upgrade/accept or /upgrade/rollback (`kimi-serve upgrade`)."""

    op: UpgradeOp


@dataclass(frozen=True)
class LkgKnown:
    """A last known good of a profile, read from the store when the daemon starts
    (daemon/upgrades.py): launches of that profile are compared with it before their gate."""

    profile: str
    tps: float | None
    accept: float | None


Event = (
    Start
    | LkgKnown
    | HostReady
    | HostNotReady
    | GpuUnfit
    | GpuFault
    | Launched
    | LaunchFailed
    | PortOpen
    | ReadyLine
    | FatalLog
    | ProbeDone
    | ChildExited
    | ChildGone
    | TimerFired
    | StopRequested
    | RestartRequested
    | ReloadRequested
    | ConfigRead
    | DrainRequested
    | UndrainRequested
    | GroupEnded
    | SpecCollapsed
    | LaunchCompared
    | UpgradeRequested
)


# --------------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Transitioned:
    old: State
    new: State
    reason: str  # a Reason value or a short free-form cause ("started", "probe ok", ...)
    detail: str = ""


@dataclass(frozen=True)
class CleanHost:
    pass


@dataclass(frozen=True)
class Launch:
    launch: int
    profile: str
    lkg: bool = False  # the last known good's command (rebuilt from a root-owned source)


@dataclass(frozen=True)
class StartProbe:
    launch: int
    kind: ProbeKind
    # The canary follows the probe, under the same probe gate. Not compared: an action list
    # reads the same with or without it (tests of the canary read the field itself).
    canary: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class StopChild:
    launch: int
    graceful: bool  # SIGTERM and drain_timeout first; else SIGKILL of the group at once


@dataclass(frozen=True)
class SetTimer:
    name: TimerName
    delay: float
    launch: int


@dataclass(frozen=True)
class CancelTimer:
    name: TimerName


@dataclass(frozen=True)
class NotifyReady:
    pass


@dataclass(frozen=True)
class RecordRestart:
    reason: Reason
    exit_code: int | None
    signal: int | None
    detail: str


@dataclass(frozen=True)
class ProfileChanged:
    old: str
    new: str


@dataclass(frozen=True)
class CheckIntent:
    launch: int
    probe: ProbeResult


@dataclass(frozen=True)
class ReadConfig:
    pass


@dataclass(frozen=True)
class NotifyReloading:
    pass


@dataclass(frozen=True)
class NotifyReloaded:
    """End systemd's reload job: READY=1 once ever ready, else STATUS= only."""

    ready: bool
    note: str = ""  # appended to the status line


@dataclass(frozen=True)
class Exit:
    code: int


@dataclass(frozen=True)
class RouterRegister:
    """Register SGLang with the router (router.url set): emitted on every entry into READY,
    the only state that is decode-verified and not being taken out."""

    launch: int


@dataclass(frozen=True)
class RouterDeregister:
    """Take SGLang out of the router and confirm it through the router's list. Emitted on
    leaving READY for any state and before every StopChild that starts a stop; the daemon
    must not carry out a StopChild before the deregistration it follows has settled."""

    launch: int
    reason: str
    wait_idle: bool  # then wait for SGLang's running + queued requests to reach 0


@dataclass(frozen=True)
class RecordLkg:
    """The launch passed its checks and served quality.trial_period (or an operator accepted
    it): it becomes the last known good of its profile, with its gate readings."""

    launch: int
    profile: str
    tps: float | None
    accept: float | None


@dataclass(frozen=True)
class RolledBack:
    """A trial regressed (or crash-looped, or an operator asked): the last known good is
    relaunched next. Counted (kimi_serve_rollbacks_total{regression}), logged, an incident."""

    launch: int
    regression: Regression
    why: str


@dataclass(frozen=True)
class UpgradeChanged:
    """/status.upgrade and kimi_serve_trial follow the machine's view of the launch."""

    state: UpgradeState
    trial: bool
    why: str


Action = (
    Transitioned
    | CleanHost
    | Launch
    | StartProbe
    | StopChild
    | SetTimer
    | CancelTimer
    | NotifyReady
    | RecordRestart
    | ProfileChanged
    | CheckIntent
    | ReadConfig
    | NotifyReloading
    | NotifyReloaded
    | Exit
    | RouterRegister
    | RouterDeregister
    | RecordLkg
    | RolledBack
    | UpgradeChanged
)
