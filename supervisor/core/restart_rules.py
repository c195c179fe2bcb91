"""The machine's restarts: whether, why, graceful or not; after the old launch is gone, the
backoff, the crash loop, the fallback profile or `failed`; with restart.mode: exit, the hand-over
to the orchestrator. No I/O. A part of `Machine` (supervisor/core/machine.py), which inherits it.
"""

from __future__ import annotations

from supervisor.config import PRIMARY
from supervisor.core.context import _REQUESTED, MachineBase, _how
from supervisor.core.events import (
    Action,
    CancelTimer,
    ChildGone,
    CleanHost,
    Exit,
    HostNotReady,
    HostReady,
    ProfileChanged,
    RecordRestart,
    RestartRequested,
    SetTimer,
    StopChild,
)
from supervisor.core.states import CHILD_STATES, HOST_CHECK, Reason, State, TimerName
from supervisor.exits import EX_RESTART_BY_ORCHESTRATOR


class RestartRules(MachineBase):
    """`_restart()` and what follows it, up to the next cleaning, `failed` or the exit."""

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
        if ctx.holding:  # a regressed trial on hold (quality.on_trial_regression): never ready
            ctx.holding = False
            return [*actions, *self._to(State.FAILED, reason, now, ctx.upgrade_why)]
        if reason in _REQUESTED:
            return [*actions, *self._to(State.CLEANING, reason, now), CleanHost()]
        if rcfg.mode == "exit":
            return [*actions, *self._hand_over(reason, now)]
        if reason is Reason.TRIAL_REGRESSED:
            # Rolled back: the last known good at once, neither backed off nor counted.
            return [*actions, *self._to(State.CLEANING, reason, now), CleanHost()]
        # A launch that served for `stable_after` earns a fresh backoff.
        if ctx.ready_at is not None and now - ctx.ready_at >= rcfg.stable_after:
            ctx.backoff = rcfg.backoff_initial
        ctx.restarts.append(now)
        while ctx.restarts and now - ctx.restarts[0] > rcfg.crash_loop.window:
            ctx.restarts.popleft()
        if len(ctx.restarts) >= rcfg.crash_loop.max_restarts:
            fallback = rcfg.fallback_profile
            n, window = rcfg.crash_loop.max_restarts, rcfg.crash_loop.window
            loop = f"{n} restarts within {window:g}s on profile {ctx.profile}"
            # A crash-looping trial is rolled back first; the last known good then gets the
            # ordinary handling (the fallback profile, then `failed`), never the trial again.
            rolled = None if ctx.on_lkg else self._crash_loop_rollback(loop)
            if rolled is not None:
                actions += rolled
            elif fallback and ctx.profile != fallback:
                actions.append(self._change_profile(fallback))
                ctx.restarts.clear()
                ctx.backoff = rcfg.backoff_initial
            else:
                if ctx.on_lkg:
                    loop += " (the last known good)"
                return [*actions, *self._to(State.FAILED, "crash_loop", now, loop)]
        # The backoff runs from the restart decision, not from the old launch's last process:
        # stopping what is left of it (seconds, for SGLang's schedulers) overlaps the wait
        # instead of adding to every restart's downtime. The gap between two launches is still
        # at least the backoff.
        wait = max(0.0, self._next_backoff() - (now - ctx.since))
        return [*actions, SetTimer(TimerName.BACKOFF, wait, ctx.launch)]

    # ------------------------------------------------------------------ asked for

    def _requested(self, event: RestartRequested, now: float) -> list[Action]:
        ctx = self.ctx
        if ctx.state in (State.STOPPING, State.STOPPED):
            return []
        actions: list[Action] = []
        # An operator's restart is the runbook's "back to primary" as much as a reload is.
        primary = event.back_to_primary or event.reason is Reason.MANUAL
        if primary and ctx.profile != PRIMARY:
            actions.append(self._change_profile(PRIMARY))
        if primary or ctx.state is State.FAILED:
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
        if ctx.state in (State.STARTING, *HOST_CHECK, State.RESTARTING):
            return actions  # nothing runs yet (or a stop is already under way)
        return [*actions, *self._restart(event.reason, now, "requested")]

    def _change_profile(self, new: str) -> ProfileChanged:
        """Launches move to profile `new`. A rollback in force stays with the profile it was
        made on: another profile (the fallback) is launched from the config, and back on the
        rolled-back profile its last known good is launched again, never the trial."""
        ctx = self.ctx
        old, ctx.profile = ctx.profile, new
        ctx.on_lkg = ctx.rolled_back == new
        return ProfileChanged(old, new)

    def _crash_loop_rollback(self, detail: str) -> list[Action] | None:
        """A crash loop's rollback to the last known good (UpgradeRules), or None."""
        return None

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
