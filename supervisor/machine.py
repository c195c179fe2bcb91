"""The supervision state machine: (state, event, time) -> (new state, actions). No I/O.

This is where every decision lives: when to launch, when SGLang counts as ready, when to
restart, with which reason, how long to back off, when a crash loop switches to the fallback
profile or gives up, what a reloaded file means, whether systemd is told READY=1 or only
STATUS=, when a restart request is refused, which watchers a transition ends. The daemon only
carries out the actions and feeds back events.

Every state change goes through `_to()`, which checks the edge against `EDGES` and emits one
`Transitioned` action (the daemon logs it, updates metrics and sends STATUS=).

What each event does in each state, for the current launch (tests/unit/test_machine_table.py
computes it and compares): the state it ends in, `=` when it acts but stays, `.` when it is
ignored. An event of an earlier launch is always ignored. RSTR is shown with its old child
still being stopped; once the child is gone the backoff timer moves it to CLEN.

```table
                       STRT CLEN LNCH LOAD WARM RDY  DEGR DRN  RSTR FAIL STPG STPD
Start                  CLEN .    .    .    .    .    .    .    .    .    .    .
HostReady              .    LNCH .    .    .    .    .    .    .    .    .    .
HostNotReady           .    =    .    .    .    .    .    .    .    .    .    .
HostNotReady wedged    .    FAIL .    .    .    .    .    .    .    .    .    .
Launched               .    .    LOAD .    .    .    .    .    .    .    .    .
LaunchFailed           .    .    RSTR RSTR RSTR RSTR RSTR RSTR =    .    STPD .
PortOpen               .    .    .    WARM .    .    .    .    .    .    .    .
ReadyLine              .    .    .    WARM .    .    .    .    .    .    .    .
FatalLog               .    .    RSTR RSTR RSTR RSTR RSTR RSTR =    .    .    .
ChildExited            .    .    RSTR RSTR RSTR RSTR RSTR RSTR .    .    .    .
ChildGone              .    .    RSTR RSTR RSTR RSTR RSTR RSTR =    .    STPD .
ChildGone stuck        .    .    RSTR RSTR RSTR RSTR RSTR RSTR FAIL .    STPD .
readiness ok           .    .    .    .    RDY  .    .    .    .    .    .    .
readiness failed       .    .    .    .    RSTR .    .    .    .    .    .    .
liveness ok            .    .    .    .    .    =    RDY  =    .    .    .    .
liveness failed        .    .    .    .    .    DEGR =    =    .    .    .    .
readiness mismatch     .    .    .    .    RSTR .    .    .    .    .    .    .
liveness mismatch      .    .    .    .    .    =    RDY  =    .    .    .    .
timer load_timeout     .    .    RSTR RSTR RSTR .    .    .    .    .    .    .
timer backoff          .    .    .    .    .    .    .    .    .    .    .    .
timer liveness         .    .    .    .    .    =    =    =    .    .    .    .
timer probe_retry      .    .    .    .    .    .    .    .    .    .    .    .
timer clean_retry      .    =    .    .    .    .    .    .    .    .    .    .
StopRequested          STPD STPD STPG STPG STPG STPG STPG STPG STPG STPD =    .
RestartRequested       .    .    RSTR RSTR RSTR RSTR RSTR RSTR .    CLEN .    .
ReloadRequested        =    =    =    =    =    =    =    =    =    =    =    =
ConfigRead invalid     =    =    =    =    =    =    =    =    =    =    =    =
ConfigRead unchanged   =    =    =    =    =    =    =    =    =    CLEN =    =
ConfigRead changed     =    =    RSTR RSTR RSTR RSTR RSTR RSTR =    CLEN =    =
GpuUnfit               .    FAIL .    .    .    .    .    .    .    .    .    .
GpuFault report        =    =    =    =    =    =    =    =    =    =    .    .
GpuFault restart       =    =    RSTR RSTR RSTR RSTR RSTR RSTR =    =    .    .
DrainRequested         .    .    .    .    .    DRN  DRN  .    .    .    .    .
UndrainRequested       .    .    .    .    .    .    .    RDY  .    .    .    .
GroupEnded             .    .    RSTR RSTR RSTR RSTR RSTR RSTR .    .    .    .
SpecCollapsed fallback .    .    .    .    .    RSTR RSTR RSTR .    .    .    .
```
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from supervisor.config import PRIMARY, Config
from supervisor.events import (
    Action,
    CancelTimer,
    CheckIntent,
    ChildExited,
    ChildGone,
    CleanHost,
    ConfigRead,
    DrainRequested,
    Event,
    Exit,
    FatalLog,
    GpuFault,
    GpuUnfit,
    GroupEnded,
    HostNotReady,
    HostReady,
    Launch,
    Launched,
    LaunchFailed,
    NotifyReady,
    NotifyReloaded,
    NotifyReloading,
    PortOpen,
    ProbeDone,
    ProfileChanged,
    ReadConfig,
    ReadyLine,
    RecordRestart,
    ReloadRequested,
    RestartRequested,
    RouterDeregister,
    RouterRegister,
    SetTimer,
    SpecCollapsed,
    Start,
    StartProbe,
    StopChild,
    StopRequested,
    TimerFired,
    Transitioned,
    UndrainRequested,
    Verdict,
)
from supervisor.exits import EX_RESTART_BY_ORCHESTRATOR
from supervisor.group_rules import (
    PeerView,
    epoch_running,
    follower_ends,
    follower_failed_ends,
    follower_may_join,
    group_ready,
    leader_ends,
)
from supervisor.states import (
    CHILD_STATES,
    EDGES,
    PROBED,
    SERVING,
    STARTUP_STATES,
    ProbeKind,
    Reason,
    State,
    TimerName,
)

# The import surface: every state, event, action and group verdict stays importable from here.
__all__ = [
    "CHILD_STATES",
    "EDGES",
    "EX_RESTART_BY_ORCHESTRATOR",
    "ILLEGAL",
    "PROBED",
    "PROBE_RETRY_DELAY",
    "SERVING",
    "STARTUP_STATES",
    "Action",
    "CancelTimer",
    "CheckIntent",
    "ChildExited",
    "ChildGone",
    "CleanHost",
    "ConfigRead",
    "Context",
    "DrainRequested",
    "Event",
    "Exit",
    "FatalLog",
    "GpuFault",
    "GpuUnfit",
    "GroupEnded",
    "HostNotReady",
    "HostReady",
    "IllegalTransition",
    "Launch",
    "LaunchFailed",
    "Launched",
    "Machine",
    "NotifyReady",
    "NotifyReloaded",
    "NotifyReloading",
    "PeerView",
    "PortOpen",
    "ProbeDone",
    "ProbeKind",
    "ProfileChanged",
    "ReadConfig",
    "ReadyLine",
    "Reason",
    "RecordRestart",
    "ReloadRequested",
    "RestartRequested",
    "RouterDeregister",
    "RouterRegister",
    "SetTimer",
    "SpecCollapsed",
    "Start",
    "StartProbe",
    "State",
    "StopChild",
    "StopRequested",
    "TimerFired",
    "TimerName",
    "Transitioned",
    "UndrainRequested",
    "Verdict",
    "WatchesEnd",
    "epoch_running",
    "extends_job",
    "follower_ends",
    "follower_failed_ends",
    "follower_may_join",
    "group_ready",
    "leader_ends",
    "watches_end",
]

# Restarts an operator asked for: SGLang drains (SIGTERM, stop.drain_timeout), and they neither
# back off nor count towards a crash loop. Every other reason means the server is already
# broken, so it is killed at once: SGLang's SIGTERM drain waits for in-flight requests with no
# time limit (docs/sglang.md, "Shutdown").
_REQUESTED = frozenset({Reason.MANUAL, Reason.RELOAD})
PROBE_RETRY_DELAY = 0.25
ILLEGAL = "illegal transition"


def _how(exit_code: int | None, sig: int | None) -> str:
    return f"killed by signal {sig}" if sig else f"exit code {exit_code}"


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Context:
    """All the machine knows. One object, so no decision hides in a flag elsewhere."""

    state: State = State.STARTING
    since: float = 0.0
    profile: str = PRIMARY
    launch: int = 0
    child: bool = False  # a process of `launch` may exist (from Launch until ChildGone)
    launched_at: float | None = None
    ready_at: float | None = None
    probe_in_flight: bool = False
    liveness_failures: int = 0
    restarts: deque[float] = field(default_factory=deque)  # times, on the current profile
    backoff: float = 0.0
    pending: Reason | None = None  # why the current child is being stopped
    pending_detail: str = ""
    host_message: str = ""  # why cleaning cannot finish, for STATUS
    host_retries: int = 0
    ever_ready: bool = False  # READY=1 has been sent once: systemd's start job is over
    canary_at: float | None = None  # when the launch's last canary was asked for
    # restart.mode: exit — stopping to let the orchestrator relaunch: exit once the host is clean.
    handing_over: bool = False


class Machine:
    def __init__(self, cfg: Config, now: float) -> None:
        self.cfg = cfg
        self.ctx = Context(since=now, backoff=cfg.restart.backoff_initial)

    # ------------------------------------------------------------------ helpers

    @property
    def state(self) -> State:
        return self.ctx.state

    def _to(self, new: State, reason: str, now: float, detail: str = "") -> list[Action]:
        old = self.ctx.state
        if new not in EDGES[old]:
            raise IllegalTransition(f"{ILLEGAL}: {old} -> {new} ({reason})")
        self.ctx.state = new
        self.ctx.since = now
        return [Transitioned(old, new, reason, detail)]

    def _cancel_launch_timers(self) -> list[Action]:
        names = (TimerName.LOAD, TimerName.LIVENESS, TimerName.PROBE_RETRY)
        return [CancelTimer(n) for n in names]

    def _current(self, launch: int) -> bool:
        return launch == self.ctx.launch

    # ------------------------------------------------------------------ entry point

    def handle(self, event: Event, now: float) -> list[Action]:
        """Decide what `event` means in the current state. Stale events are dropped."""
        before = self.ctx.state
        match event:
            case DrainRequested():
                actions = self._drain(now)
            case UndrainRequested():
                actions = self._undrain(now)
            case _:
                actions = self._decide(event, now)
        return self._with_router(before, actions)

    def _decide(self, event: Event, now: float) -> list[Action]:
        ctx = self.ctx
        match event:
            case StopRequested():
                return self._stop(event, now)
            case Start() if ctx.state is State.STARTING:
                return [*self._to(State.CLEANING, "started", now), CleanHost()]
            case HostReady() | HostNotReady() if ctx.state is State.STOPPING and ctx.handing_over:
                return self._handed_over(event, now)
            case HostReady() if ctx.state is State.CLEANING:
                return self._launch(now)
            case HostNotReady() if ctx.state is State.CLEANING:
                return self._host_not_ready(event, now)
            case GpuUnfit() if ctx.state is State.CLEANING:
                # Never launch onto a GPU that needs a reset, a reboot or a replacement: every
                # relaunch would be another long load that fails. Only an operator can fix it.
                ctx.host_message = event.line
                return self._to(State.FAILED, "gpu_unfit", now, event.line)
            case GpuFault():
                return self._gpu_fault(event, now)
            case TimerFired(name=TimerName.CLEAN_RETRY) if ctx.state is State.CLEANING:
                return [CleanHost()]
            case Launched() if self._current(event.launch) and ctx.state is State.LAUNCHING:
                ctx.launched_at = now
                return [
                    *self._to(State.LOADING, "launched", now, f"pid {event.pid}"),
                    SetTimer(TimerName.LOAD, self.cfg.readiness.load_timeout, ctx.launch),
                ]
            case LaunchFailed() if self._current(event.launch) and ctx.child:
                # The exec itself failed: no process exists, so nothing needs stopping.
                if ctx.state is State.LAUNCHING:
                    ctx.child = False
                    return self._restart(Reason.EXITED, now, event.message)
                return self._child_gone(ChildGone(event.launch, None, None), now)
            case PortOpen() | ReadyLine() if self._current(event.launch):
                return self._server_up(event, now)
            case SpecCollapsed() if self._current(event.launch) and ctx.state in PROBED:
                return self._spec_collapsed(event, now)
            case GroupEnded() if self._current(event.launch) and ctx.state in CHILD_STATES:
                return self._restart(Reason.GROUP, now, event.detail)
            case FatalLog() if self._current(event.launch) and ctx.state in CHILD_STATES:
                return self._restart(Reason.FATAL_LOG, now, event.line)
            case FatalLog() if self._current(event.launch) and self._explains_exit():
                return self._fatal_explains_exit(event, now)
            case ChildExited() if self._current(event.launch) and ctx.state in CHILD_STATES:
                how = _how(event.exit_code, event.signal)
                detail = f"{event.process} {how}" if event.process else how
                return self._restart(Reason.EXITED, now, detail)
            case ProbeDone() if self._current(event.launch):
                ctx.probe_in_flight = False
                return self._probe_done(event, now)
            case ChildGone() if self._current(event.launch) and ctx.child:
                return self._child_gone(event, now)
            case TimerFired() if self._current(event.launch):
                return self._timer(event, now)
            case RestartRequested():
                return self._requested(event, now)
            case ReloadRequested():
                # RELOADING=1 opens a reload job; before the first READY=1 the start job is
                # still open and a reload job would confuse it.
                return [*([NotifyReloading()] if ctx.ever_ready else []), ReadConfig()]
            case ConfigRead():
                return self._config_read(event, now)
        return []

    def refuse_restart(self) -> str | None:
        """Why an operator's restart request (POST /restart) is refused, or None."""
        if self.ctx.state in (State.STOPPING, State.STOPPED):
            return "the daemon is stopping"
        return None

    def _config_read(self, event: ConfigRead, now: float) -> list[Action]:
        ready = self.ctx.ever_ready
        if event.verdict is Verdict.INVALID:
            return [NotifyReloaded(ready, " (reload refused: config invalid)")]
        # Unchanged while `failed`: `failed` lasts until a reload, and the operator fixed the
        # host, not the file.
        if event.verdict is Verdict.UNCHANGED and self.ctx.state is not State.FAILED:
            return [NotifyReloaded(ready)]
        again = RestartRequested(Reason.RELOAD, back_to_primary=True)
        return [NotifyReloaded(ready), *self._requested(again, now)]

    # ------------------------------------------------------------------ per event

    def _host_not_ready(self, event: HostNotReady, now: float) -> list[Action]:
        self.ctx.host_message = event.message
        if event.wedged:
            return self._to(State.FAILED, "gpu_wedged", now, event.message)
        # A host problem (memory still held, port busy) may clear by itself; retry with a
        # backoff of its own (a slow mount must not lengthen the next crash's backoff) and say
        # why in STATUS meanwhile: old == new marks an update of the same state.
        rcfg = self.cfg.restart
        delay = min(max(rcfg.backoff_initial, 1.0) * 2**self.ctx.host_retries, rcfg.backoff_max)
        self.ctx.host_retries += 1
        return [
            Transitioned(State.CLEANING, State.CLEANING, "host_not_ready", event.message),
            SetTimer(TimerName.CLEAN_RETRY, delay, self.ctx.launch),
        ]

    def _gpu_fault(self, event: GpuFault, now: float) -> list[Action]:
        ctx = self.ctx
        if ctx.state in (State.STOPPING, State.STOPPED):
            return []
        if event.restart and ctx.state in CHILD_STATES:
            # SIGKILL, no drain: a lost GPU cannot finish requests. The next cleaning reads
            # fitness again and goes `failed` if the GPU still needs the action.
            return self._restart(Reason.GPU_FAULT, now, event.line)
        # Reported at once (old == new marks an update of the same state); the server keeps
        # serving when the driver asks for nothing.
        return [Transitioned(ctx.state, ctx.state, "gpu_fault", event.line)]

    def _launch(self, now: float) -> list[Action]:
        ctx = self.ctx
        ctx.launch += 1
        ctx.child = True
        ctx.launched_at = None
        ctx.ready_at = None
        ctx.probe_in_flight = False
        ctx.liveness_failures = 0
        ctx.pending = None
        ctx.host_message = ""
        ctx.host_retries = 0
        return [
            *self._to(State.LAUNCHING, "host_ready", now, f"profile {ctx.profile}"),
            Launch(ctx.launch, ctx.profile),
        ]

    def _server_up(self, event: PortOpen | ReadyLine, now: float) -> list[Action]:
        ctx = self.ctx
        actions: list[Action] = []
        if ctx.state is State.LOADING:
            cause = "ready_line" if isinstance(event, ReadyLine) else "port_open"
            actions += self._to(State.WARMING, cause, now)
        elif ctx.state is not State.WARMING:
            return []
        if self.cfg.group.role == "follower":
            # A follower's port is SGLang's dummy health server, which answers 200 whatever
            # the schedulers do (docs/sglang.md, "Multi-node"): nothing there to probe. Its
            # schedulers are loaded once it listens; the replica's decode is the leader's.
            ctx.ready_at = now
            ctx.ever_ready = True
            return [
                *actions,
                *self._to(State.READY, "follower_up", now, "schedulers up; decode on the leader"),
                CancelTimer(TimerName.LOAD),
                NotifyReady(),
            ]
        if ctx.probe_in_flight:
            return actions
        ctx.probe_in_flight = True
        return [
            *actions,
            CancelTimer(TimerName.PROBE_RETRY),
            StartProbe(ctx.launch, ProbeKind.READINESS, canary=self._canary_on),
        ]

    @property
    def _canary_on(self) -> bool:
        return self.cfg.quality.canary.enabled

    def _spec_collapsed(self, event: SpecCollapsed, now: float) -> list[Action]:
        """TensorRT-LLM turns speculation off below a configured acceptance; here the launch
        moves to restart.fallback_profile (a profile without speculation). Back to the primary
        on a reload (docs/quality.md)."""
        ctx, fallback = self.ctx, self.cfg.restart.fallback_profile
        if self.cfg.quality.on_spec_collapse != "fallback" or not fallback:
            return []
        if ctx.profile == fallback:
            return []  # already there: reported only
        old, ctx.profile = ctx.profile, fallback
        ctx.restarts.clear()
        return [
            ProfileChanged(old, fallback),
            *self._restart(Reason.SPEC_COLLAPSE, now, event.detail),
        ]

    def _probe_done(self, event: ProbeDone, now: float) -> list[Action]:
        ctx = self.ctx
        r = event.result
        if event.kind is ProbeKind.READINESS and ctx.state is State.WARMING:
            ccfg = self.cfg.quality.canary
            if r.ok and event.canary_mismatch and ccfg.policy == "gate":
                # Never ready on a wrong answer; counts towards the crash loop like any other
                # unrequested restart, so the fallback profile is tried.
                return self._restart(Reason.CANARY_MISMATCH, now, event.canary_mismatch)
            if r.ok:
                ctx.ready_at = now
                ctx.ever_ready = True
                ctx.canary_at = now
                return [
                    *self._to(State.READY, "probe_ok", now, f"{r.completion_tokens} tokens"),
                    CancelTimer(TimerName.LOAD),
                    NotifyReady(),
                    SetTimer(TimerName.LIVENESS, self.cfg.liveness.interval, ctx.launch),
                    CheckIntent(ctx.launch, r),
                ]
            if r.not_up or event.busy:
                # Not serving yet (503, refused) or busy: try again until load_timeout.
                return [SetTimer(TimerName.PROBE_RETRY, PROBE_RETRY_DELAY, ctx.launch)]
            return self._restart(Reason.READINESS_FAILED, now, r.error or r.reason)
        if event.kind is ProbeKind.LIVENESS and ctx.state in PROBED:
            actions: list[Action] = [
                SetTimer(TimerName.LIVENESS, self.cfg.liveness.interval, ctx.launch)
            ]
            if r.ok and event.canary_mismatch:
                # Serving already: reported (quality.degraded), never a restart by itself.
                why = event.canary_mismatch
                actions = [
                    Transitioned(ctx.state, ctx.state, Reason.CANARY_MISMATCH, why),
                    *actions,
                ]
            if r.ok:
                ctx.liveness_failures = 0
                if ctx.state is State.DEGRADED:
                    actions = [*self._to(State.READY, "probe_ok", now), *actions]
                return actions
            if event.busy:
                # A busy server is not a failed one: generation advanced while we waited.
                return actions
            ctx.liveness_failures += 1
            threshold = self.cfg.liveness.failure_threshold
            detail = f"{r.error or r.reason} ({ctx.liveness_failures}/{threshold})"
            if ctx.liveness_failures >= threshold:
                return self._restart(Reason.LIVENESS_FAILED, now, detail)
            if ctx.state is State.READY:
                return [*self._to(State.DEGRADED, "probe_failed", now, detail), *actions]
            return [Transitioned(ctx.state, ctx.state, "probe_failed", detail), *actions]
        return []

    def _timer(self, event: TimerFired, now: float) -> list[Action]:
        ctx = self.ctx
        match event.name:
            case TimerName.LOAD if ctx.state in (State.LAUNCHING, State.LOADING, State.WARMING):
                budget = self.cfg.readiness.load_timeout
                return self._restart(Reason.LOAD_TIMEOUT, now, f"no decode within {budget:g}s")
            case TimerName.PROBE_RETRY if ctx.state is State.WARMING and not ctx.probe_in_flight:
                ctx.probe_in_flight = True
                return [StartProbe(ctx.launch, ProbeKind.READINESS, canary=self._canary_on)]
            case TimerName.LIVENESS if ctx.state in PROBED and not ctx.probe_in_flight:
                ctx.probe_in_flight = True
                # quality.canary.interval: the first liveness probe after it carries the
                # canary, so there is never a second probe in flight.
                last = ctx.canary_at
                due = last is None or now - last >= self.cfg.quality.canary.interval
                canary = due and self._canary_on
                if canary:
                    ctx.canary_at = now
                return [StartProbe(ctx.launch, ProbeKind.LIVENESS, canary=canary)]
            # Never relaunch while a process of the old launch may still hold the GPUs.
            case TimerName.BACKOFF if ctx.state is State.RESTARTING and not ctx.child:
                return [*self._to(State.CLEANING, "backoff_elapsed", now), CleanHost()]
        return []

    def _requested(self, event: RestartRequested, now: float) -> list[Action]:
        ctx = self.ctx
        if ctx.state in (State.STOPPING, State.STOPPED):
            return []
        actions: list[Action] = []
        if event.back_to_primary and ctx.profile != PRIMARY:
            actions.append(ProfileChanged(ctx.profile, PRIMARY))
            ctx.profile = PRIMARY
        if event.back_to_primary or ctx.state is State.FAILED:
            ctx.restarts.clear()
            ctx.backoff = self.cfg.restart.backoff_initial
        if ctx.state is State.FAILED:
            return [
                *actions,
                RecordRestart(event.reason, None, None, "requested"),
                *self._to(State.CLEANING, event.reason, now),
                CleanHost(),
            ]
        if ctx.state is State.RESTARTING and not ctx.child:
            # Waiting out a backoff: go now.
            return [
                *actions,
                CancelTimer(TimerName.BACKOFF),
                *self._to(State.CLEANING, event.reason, now),
                CleanHost(),
            ]
        if ctx.state in (State.STARTING, State.CLEANING, State.RESTARTING):
            return actions  # nothing runs yet (or a stop is already under way)
        return [*actions, *self._restart(event.reason, now, "requested")]

    def _stop(self, event: StopRequested, now: float) -> list[Action]:
        ctx = self.ctx
        if ctx.state is State.STOPPED:
            return []
        if ctx.state is State.STOPPING:
            # A second SIGTERM/SIGINT while draining: stop waiting, kill now.
            return [StopChild(ctx.launch, graceful=False)] if ctx.child else []
        timers = [CancelTimer(n) for n in TimerName]
        actions: list[Action] = [*self._to(State.STOPPING, event.signal_name, now), *timers]
        if ctx.child:
            return [*actions, StopChild(ctx.launch, graceful=True)]
        return [*actions, *self._to(State.STOPPED, "no_child", now), Exit(0)]

    def _explains_exit(self) -> bool:
        # A restart for a death is under way and the old launch is still being stopped (its
        # pipes are drained before ChildGone): a fatal line read now is why it died.
        ctx = self.ctx
        return ctx.state is State.RESTARTING and ctx.child and ctx.pending is Reason.EXITED

    def _fatal_explains_exit(self, event: FatalLog, now: float) -> list[Action]:
        """A traceback, then death by signal 9: SGLang's scheduler logs its exception and, with
        SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1, SIGKILLs its whole process group at once
        (managers/scheduler.py:6372-6380). The pidfd can report the death before the pipe
        delivers the traceback's last line; the restart is the traceback's (`fatal_log`), and
        the exit is kept as it was."""
        ctx = self.ctx
        ctx.pending = Reason.FATAL_LOG
        ctx.pending_detail = event.line
        return [Transitioned(State.RESTARTING, State.RESTARTING, Reason.FATAL_LOG, event.line)]

    # ------------------------------------------------------------------ drain and router

    def drain_refusal(self) -> str | None:
        """Why POST /drain cannot be honoured now (None: it can, or it is already draining)."""
        if self.ctx.state in PROBED:
            return None
        return f"nothing to drain: SGLang is not serving (state {self.ctx.state})"

    def undrain_refusal(self) -> str | None:
        if self.ctx.state is State.DRAINING:
            return None
        return f"not draining (state {self.ctx.state})"

    def _drain(self, now: float) -> list[Action]:
        if self.ctx.state not in SERVING:
            return []  # already draining, or nothing serves: see drain_refusal()
        return self._to(State.DRAINING, "drain", now, "requested")

    def _undrain(self, now: float) -> list[Action]:
        ctx = self.ctx
        if ctx.state is not State.DRAINING:
            return []
        if ctx.liveness_failures:
            threshold = self.cfg.liveness.failure_threshold
            detail = f"liveness failing ({ctx.liveness_failures}/{threshold})"
            return self._to(State.DEGRADED, "undrain", now, detail)
        return self._to(State.READY, "undrain", now)

    def _with_router(self, before: State, actions: list[Action]) -> list[Action]:
        """With router.url set: register on entering READY; deregister on leaving it, and
        before every stop of SGLang (whatever the reason), ahead of its StopChild."""
        if not self.cfg.router.enabled or self.cfg.group.role == "follower":
            # Only the leader (rank 0) serves requests; a follower is never registered.
            return actions
        out: list[Action] = []
        deregistered = False
        for a in actions:
            if isinstance(a, StopChild) and before is not State.STOPPING and not deregistered:
                # A stop of a serving SGLang waits for its requests only when it is graceful;
                # a broken one is killed at once (see _REQUESTED).
                idle = a.graceful and before in PROBED
                why = self.ctx.pending.value if self.ctx.pending else "stop"
                out.append(RouterDeregister(a.launch, why, wait_idle=idle))
                deregistered = True
            out.append(a)
            if isinstance(a, Transitioned) and a.old is not a.new:
                if a.new is State.READY:
                    out.append(RouterRegister(self.ctx.launch))
                elif a.old is State.READY and a.new in (State.DEGRADED, State.DRAINING):
                    drain = a.new is State.DRAINING
                    out.append(RouterDeregister(self.ctx.launch, a.new.value, wait_idle=drain))
                    deregistered = a.new is State.DEGRADED
                elif a.old is State.DEGRADED and a.new is State.DRAINING:
                    out.append(RouterDeregister(self.ctx.launch, "drain", wait_idle=True))
        return out

    # ------------------------------------------------------------------ restarts

    def _restart(
        self,
        reason: Reason,
        now: float,
        detail: str,
        exit_code: int | None = None,
        sig: int | None = None,
    ) -> list[Action]:
        ctx = self.ctx
        if ctx.state in (State.RESTARTING, State.STOPPING, State.STOPPED, State.FAILED):
            return []
        ctx.pending = reason
        ctx.pending_detail = detail
        ctx.probe_in_flight = False
        actions: list[Action] = [
            *self._to(State.RESTARTING, reason, now, detail),
            *self._cancel_launch_timers(),
        ]
        if ctx.child:
            # A collapse of speculation still serves right: drain it like a requested restart.
            graceful = reason in _REQUESTED or reason is Reason.SPEC_COLLAPSE
            return [*actions, StopChild(ctx.launch, graceful=graceful)]
        return [*actions, *self._after_gone(exit_code, sig, now)]

    def _child_gone(self, event: ChildGone, now: float) -> list[Action]:
        ctx = self.ctx
        ctx.child = False
        if event.stuck:
            # SIGKILL cannot reach a process stuck in the driver: its GPU memory stays held,
            # so a relaunch would only fail. Say so and stop trying.
            pids = ", ".join(str(p) for p in event.stuck)
            detail = f"process {pids} survives SIGKILL (stuck in the kernel, D state)"
            if ctx.state is State.STOPPING:
                return [*self._to(State.STOPPED, "child_stuck", now, detail), Exit(1)]
            if ctx.state is State.RESTARTING:
                reason = ctx.pending or Reason.EXITED
                ctx.pending = None
                return [
                    RecordRestart(reason, event.exit_code, event.signal, ctx.pending_detail),
                    *self._to(State.FAILED, "process_stuck", now, detail),
                ]
        if ctx.state is State.STOPPING:
            return [*self._to(State.STOPPED, "child_stopped", now), Exit(0)]
        if ctx.state is State.RESTARTING:
            return self._after_gone(event.exit_code, event.signal, now)
        if ctx.state in CHILD_STATES:
            # Gone without being stopped: the same as an exit of its own.
            return self._restart(
                Reason.EXITED,
                now,
                _how(event.exit_code, event.signal),
                event.exit_code,
                event.signal,
            )
        return []

    def _next_backoff(self) -> float:
        delay = self.ctx.backoff
        self.ctx.backoff = min(
            max(delay * 2, self.cfg.restart.backoff_initial), self.cfg.restart.backoff_max
        )
        return delay

    def _after_gone(self, exit_code: int | None, sig: int | None, now: float) -> list[Action]:
        """The old launch is fully gone: record why, then back off, fall back, or give up."""
        ctx = self.ctx
        reason = ctx.pending or Reason.EXITED
        rcfg = self.cfg.restart
        actions: list[Action] = [RecordRestart(reason, exit_code, sig, ctx.pending_detail)]
        ctx.pending = None
        if reason in _REQUESTED:
            return [*actions, *self._to(State.CLEANING, reason, now), CleanHost()]
        if rcfg.mode == "exit":
            return [*actions, *self._hand_over(reason, now)]
        # A launch that served for `stable_after` earns a fresh backoff.
        if ctx.ready_at is not None and now - ctx.ready_at >= rcfg.stable_after:
            ctx.backoff = rcfg.backoff_initial
        ctx.restarts.append(now)
        while ctx.restarts and now - ctx.restarts[0] > rcfg.crash_loop.window:
            ctx.restarts.popleft()
        if len(ctx.restarts) >= rcfg.crash_loop.max_restarts:
            fallback = rcfg.fallback_profile
            if fallback and ctx.profile != fallback:
                actions.append(ProfileChanged(ctx.profile, fallback))
                ctx.profile = fallback
                ctx.restarts.clear()
                ctx.backoff = rcfg.backoff_initial
            else:
                n = rcfg.crash_loop.max_restarts
                window = rcfg.crash_loop.window
                return [
                    *actions,
                    *self._to(
                        State.FAILED,
                        "crash_loop",
                        now,
                        f"{n} restarts within {window:g}s on profile {ctx.profile}",
                    ),
                ]
        # The backoff runs from the restart decision, not from the old launch's last process:
        # stopping what is left of it (seconds, for SGLang's schedulers) overlaps the wait
        # instead of adding to every restart's downtime. The gap between two launches is still
        # at least the backoff.
        wait = max(0.0, self._next_backoff() - (now - ctx.since))
        return [*actions, SetTimer(TimerName.BACKOFF, wait, ctx.launch)]

    # ------------------------------------------------------------------ restart.mode: exit

    def _hand_over(self, reason: Reason, now: float) -> list[Action]:
        """Instead of relaunching alone: clean the host, then exit for the orchestrator.

        A node of a multi-node replica cannot rejoin a running group (the others block in NCCL
        until SGLang's watchdog), so the whole group must relaunch together; under Kubernetes
        the LeaderWorkerSet's RecreateGroupOnPodRestart does that when this process exits. The
        old launch is already gone (ChildGone); the cleaning removes what it may have left on
        the GPUs, so nothing of it outlives the daemon.
        """
        self.ctx.handing_over = True
        detail = f"{reason}: {self.ctx.pending_detail}" if self.ctx.pending_detail else reason
        return [
            *self._to(State.STOPPING, "restart_mode_exit", now, detail),
            *[CancelTimer(n) for n in TimerName],
            CleanHost(),
        ]

    def _handed_over(self, event: HostReady | HostNotReady, now: float) -> list[Action]:
        self.ctx.handing_over = False
        code = EX_RESTART_BY_ORCHESTRATOR
        if isinstance(event, HostNotReady):
            # Exit all the same: the orchestrator's relaunch (maybe elsewhere) is the way on.
            detail = f"host not clean: {event.message}; exit {code}"
            return [*self._to(State.STOPPED, "restart_mode_exit", now, detail), Exit(code)]
        detail = f"exit {code}: the orchestrator relaunches the group"
        return [*self._to(State.STOPPED, "restart_mode_exit", now, detail), Exit(code)]


def extends_job(state: State, ever_ready: bool) -> bool:
    """Whether systemd's start (or stop) job is still running and must be extended.

    Until the first READY=1 the start job runs: it is extended through loads, probes and the
    backoffs between them, or a crash loop would time the start out before the fallback profile
    is ever tried. Not in `failed`: a start that cannot succeed should fail, not hang
    `systemctl start` for ever.
    """
    if state is State.STOPPING:
        return True
    return not ever_ready and state in (*STARTUP_STATES, State.RESTARTING)


@dataclass(frozen=True)
class WatchesEnd:
    """Which watchers of the launch a transition ends."""

    port: bool  # the port watcher (it only matters while launching/loading)
    tree: bool  # the descendant recorder (kept while a stop may still need the tree)


def watches_end(t: Transitioned) -> WatchesEnd:
    if t.old is State.LOADING or t.new not in (State.LAUNCHING, State.LOADING):
        return WatchesEnd(port=True, tree=t.new not in (State.RESTARTING, State.STOPPING))
    return WatchesEnd(port=False, tree=False)
