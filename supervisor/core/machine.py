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
                           STRT CLEN WAIT LNCH LOAD WARM RDY  DEGR DRN  RSTR FAIL STPG STPD
Start                      CLEN .    .    .    .    .    .    .    .    .    .    .    .
HostReady                  .    LNCH LNCH .    .    .    .    .    .    .    .    .    .
HostNotReady               .    =    CLEN .    .    .    .    .    .    .    .    .    .
HostNotReady wedged        .    FAIL FAIL .    .    .    .    .    .    .    .    .    .
HostNotReady model_missing .    WAIT =    .    .    .    .    .    .    .    .    .    .
Launched                   .    .    .    LOAD .    .    .    .    .    .    .    .    .
LaunchFailed               .    .    .    RSTR RSTR RSTR RSTR RSTR RSTR =    .    STPD .
PortOpen                   .    .    .    .    WARM .    .    .    .    .    .    .    .
ReadyLine                  .    .    .    .    WARM .    .    .    .    .    .    .    .
FatalLog                   .    .    .    RSTR RSTR RSTR RSTR RSTR RSTR =    .    .    .
ChildExited                .    .    .    RSTR RSTR RSTR RSTR RSTR RSTR .    .    .    .
ChildGone                  .    .    .    RSTR RSTR RSTR RSTR RSTR RSTR =    .    STPD .
ChildGone stuck            .    .    .    RSTR RSTR RSTR RSTR RSTR RSTR FAIL .    STPD .
readiness ok               .    .    .    .    .    RDY  .    .    .    .    .    .    .
readiness failed           .    .    .    .    .    RSTR .    .    .    .    .    .    .
liveness ok                .    .    .    .    .    .    =    RDY  =    .    .    .    .
liveness failed            .    .    .    .    .    .    DEGR =    =    .    .    .    .
readiness mismatch         .    .    .    .    .    RSTR .    .    .    .    .    .    .
readiness no canary        .    .    .    .    .    =    .    .    .    .    .    .    .
liveness no canary         .    .    .    .    .    .    =    RDY  =    .    .    .    .
liveness mismatch          .    .    .    .    .    .    =    RDY  =    .    .    .    .
timer load_timeout         .    .    .    RSTR RSTR RSTR .    .    .    .    .    .    .
timer backoff              .    .    .    .    .    .    .    .    .    .    .    .    .
timer liveness             .    .    .    .    .    .    =    =    =    .    .    .    .
timer probe_retry          .    .    .    .    .    .    .    .    .    .    .    .    .
timer clean_retry          .    =    =    .    .    .    .    .    .    .    .    .    .
StopRequested              STPD STPD STPD STPG STPG STPG STPG STPG STPG STPG STPD =    .
RestartRequested           .    .    .    RSTR RSTR RSTR RSTR RSTR RSTR .    CLEN .    .
ReloadRequested            =    =    =    =    =    =    =    =    =    =    =    =    =
ConfigRead invalid         =    =    =    =    =    =    =    =    =    =    =    =    =
ConfigRead unchanged       =    =    =    =    =    =    =    =    =    =    CLEN =    =
ConfigRead changed         =    =    =    RSTR RSTR RSTR RSTR RSTR RSTR =    CLEN =    =
GpuUnfit                   .    FAIL FAIL .    .    .    .    .    .    .    .    .    .
GpuFault report            =    =    =    =    =    =    =    =    =    =    =    .    .
GpuFault restart           =    =    =    RSTR RSTR RSTR RSTR RSTR RSTR =    =    .    .
DrainRequested             .    .    .    .    .    .    DRN  DRN  .    .    .    .    .
UndrainRequested           .    .    .    .    .    .    .    .    RDY  .    .    .    .
GroupEnded                 .    .    .    RSTR RSTR RSTR RSTR RSTR RSTR .    .    .    .
SpecCollapsed fallback     .    .    .    .    .    .    RSTR RSTR RSTR .    .    .    .
```
"""

from __future__ import annotations

from supervisor.config import PRIMARY
from supervisor.core.context import (
    _REQUESTED as _REQUESTED,
)
from supervisor.core.context import (
    ILLEGAL,
    PROBE_RETRY_DELAY,
    Context,
    IllegalTransition,
    _how,
)
from supervisor.core.drain_rules import DrainRules
from supervisor.core.events import (
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
    LaunchCompared,
    Launched,
    LaunchFailed,
    LkgKnown,
    NotifyReady,
    NotifyReloaded,
    NotifyReloading,
    PortOpen,
    ProbeDone,
    ProfileChanged,
    ReadConfig,
    ReadyLine,
    RecordLkg,
    RecordRestart,
    ReloadRequested,
    RestartRequested,
    RolledBack,
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
    UpgradeChanged,
    UpgradeOp,
    UpgradeRequested,
    Verdict,
)
from supervisor.core.group_rules import (
    PeerView,
    epoch_running,
    follower_ends,
    follower_failed_ends,
    follower_may_join,
    group_ready,
    leader_ends,
)
from supervisor.core.host_rules import MODEL_MISSING, HostRules
from supervisor.core.jobs import EXTEND_BY_S, WatchesEnd, extends_job, watches_end
from supervisor.core.states import (
    CHILD_STATES,
    EDGES,
    HOST_CHECK,
    PROBED,
    SERVING,
    STARTUP_STATES,
    ProbeKind,
    Reason,
    Regression,
    State,
    TimerName,
    TrialVerdict,
    UpgradeState,
)
from supervisor.exits import EX_RESTART_BY_ORCHESTRATOR

# The import surface: every state, event, action and group verdict stays importable from here.
__all__ = [
    "CHILD_STATES",
    "EDGES",
    "EXTEND_BY_S",
    "EX_RESTART_BY_ORCHESTRATOR",
    "ILLEGAL",
    "MODEL_MISSING",
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
    "LaunchCompared",
    "LaunchFailed",
    "Launched",
    "LkgKnown",
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
    "RecordLkg",
    "RecordRestart",
    "Regression",
    "ReloadRequested",
    "RestartRequested",
    "RolledBack",
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
    "TrialVerdict",
    "UndrainRequested",
    "UpgradeChanged",
    "UpgradeOp",
    "UpgradeRequested",
    "UpgradeState",
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


class Machine(HostRules, DrainRules):
    """Every decision, by concern: `Context` (core/context.py), the restarts
    (core/restart_rules.py), the trials and the last known good (core/upgrade_rules.py), the
    probes (core/probe_rules.py), drain and router (core/drain_rules.py), and here the entry
    point and the rest of the events."""

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
        actions = self._with_router(before, actions)
        if self.ctx.internal_error:
            actions = [Exit(1) if isinstance(a, Exit) else a for a in actions]
        return actions

    # ------------------------------------------------------------------ asked by the daemon

    def internal_error(self) -> None:
        """An effect failed (the daemon stops with StopRequested("internal-error")): every
        exit from now on is 1, whatever code the stop would have had."""
        self.ctx.internal_error = True

    def ready(self, child_dying: bool, group_ready: bool | None) -> bool:
        """/readyz and kimi_serve_ready: never while a worker's death is being reported; a
        node of a multi-node group by the group's rule (`group_ready`); else the state."""
        if child_dying:
            return False
        if group_ready is not None:
            return group_ready
        return self.ctx.state in SERVING

    def joins_group(self, cleaned: Event) -> bool:
        """After a cleaning: a follower launches only into the leader's next epoch, so it joins
        first (group.Group.join); not when the cleaning was for handing over (restart.mode)."""
        joins = isinstance(cleaned, HostReady) and not self.ctx.handing_over
        return joins and self.cfg.group.role == "follower"

    def stays_ready(self, verdict: Verdict) -> bool:
        """A reload with this verdict leaves a `ready` server serving (no restart follows):
        a newly configured router gets it at once (router.relink)."""
        unchanged = verdict is Verdict.UNCHANGED and self.ctx.profile == PRIMARY
        return unchanged and self.ctx.state is State.READY

    def job_extension(self) -> float | None:
        """How long systemd's running start (or stop) job is to be extended, or None
        (`extends_job`); a stop gets the drain's budget on top."""
        state = self.ctx.state
        if not extends_job(state, self.ctx.ever_ready):
            return None
        return EXTEND_BY_S + self.cfg.stop.drain_timeout * (state is State.STOPPING)

    def _decide(self, event: Event, now: float) -> list[Action]:
        ctx = self.ctx
        match event:
            case StopRequested():
                return self._stop(event, now)
            case Start() if ctx.state is State.STARTING:
                return [*self._to(State.CLEANING, "started", now), CleanHost()]
            case HostReady() | HostNotReady() if ctx.state is State.STOPPING and ctx.handing_over:
                return self._handed_over(event, now)
            case HostReady() if ctx.state in HOST_CHECK:
                return self._launch(now)
            case HostNotReady() if ctx.state in HOST_CHECK:
                return self._host_not_ready(event, now)
            case GpuUnfit() if ctx.state in HOST_CHECK:
                # Never launch onto a GPU that needs a reset, a reboot or a replacement: every
                # relaunch would be another long load that fails. Only an operator can fix it.
                ctx.host_message = event.line
                return self._to(State.FAILED, "gpu_unfit", now, event.line)
            case GpuFault():
                return self._gpu_fault(event, now)
            case TimerFired(name=TimerName.CLEAN_RETRY) if ctx.state in HOST_CHECK:
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
            case LaunchCompared() if self._current(event.launch):
                return self._compared(event)
            case LkgKnown():
                self.ctx.lkgs[event.profile] = (event.tps, event.accept)
                return []
            case UpgradeRequested():
                return self._upgrade_requested(event, now)
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
        # host, not the file. Unchanged on the fallback profile: back to primary (the runbook's
        # way back after a fix outside the file, a draft model or the SGLang venv).
        # A reload also ends a rollback or a hold: the config is a new trial, launched again.
        unchanged = event.verdict is Verdict.UNCHANGED and self.ctx.profile == PRIMARY
        unchanged = not self._reloaded() and unchanged
        if unchanged and self.ctx.state is not State.FAILED:
            return [NotifyReloaded(ready)]
        again = RestartRequested(Reason.RELOAD, back_to_primary=True)
        return [NotifyReloaded(ready), *self._requested(again, now)]
