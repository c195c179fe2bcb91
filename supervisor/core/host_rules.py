"""The host and the launch's own events: a host not ready yet (`cleaning`, `waiting`), a GPU
fault, a launch, the timers (load, probe retry, liveness, backoff), a stop, and a fatal line
that explains a death. No I/O. A part of `Machine` (supervisor/core/machine.py), which
inherits it; it inherits the probes' rules (core/probe_rules.py) and through them the
restarts' and the trials'."""

from __future__ import annotations

from supervisor.core.events import (
    Action,
    CancelTimer,
    CleanHost,
    Exit,
    FatalLog,
    GpuFault,
    HostNotReady,
    Launch,
    SetTimer,
    StartProbe,
    StopChild,
    StopRequested,
    TimerFired,
    Transitioned,
)
from supervisor.core.probe_rules import ProbeRules
from supervisor.core.states import (
    CHILD_STATES,
    PROBED,
    ProbeKind,
    Reason,
    State,
    TimerName,
    UpgradeState,
)

# The transition reason of `waiting`: a model or draft model path is missing.
MODEL_MISSING = "model_missing"


class HostRules(ProbeRules):
    """What the host, the timers and a stop ask of the launch."""

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
        retry = SetTimer(TimerName.CLEAN_RETRY, delay, self.ctx.launch)
        # A missing model (a mount not up yet) is `waiting`, said by its state and reason rather
        # than a `cleaning` that names GPUs; it never counts towards the crash loop.
        new = State.WAITING if event.model_missing else State.CLEANING
        why = MODEL_MISSING if event.model_missing else "host_not_ready"
        if new is not self.ctx.state:
            return [*self._to(new, why, now, event.message), retry]
        return [Transitioned(new, new, why, event.message), retry]

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
        ctx.canary_tries = 0
        ctx.pending = None
        ctx.host_message = ""
        ctx.host_retries = 0
        # Without a last known good of its profile there is nothing to compare it with.
        ctx.compared = ctx.profile not in ctx.lkgs
        was_trial = ctx.trial
        ctx.has_lkg = ctx.trial = ctx.regressed = ctx.awaiting_lkg = False
        ctx.rollback_refusal = None
        ctx.gate_tps = ctx.gate_accept = ctx.verdict = None
        notes: list[Action] = []
        if ctx.compared and (was_trial or ctx.upgrade is not UpgradeState.NONE):
            # Nothing to compare it with (the fallback profile has no LKG yet): no trial.
            why = f"no last known good yet for profile {ctx.profile}"
            notes = self._upgrade_is(UpgradeState.NONE, why)
        what = f"profile {ctx.profile}" + (", the last known good" if ctx.on_lkg else "")
        return [
            *self._to(State.LAUNCHING, "host_ready", now, what),
            *notes,
            Launch(ctx.launch, ctx.profile, lkg=ctx.on_lkg),
        ]

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
