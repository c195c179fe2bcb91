"""What the server's signs mean to the machine: the port or ready line (`_server_up`), a
collapse of speculation (`_spec_collapsed`), a readiness or liveness probe's result
(`_probe_done`). No I/O. A part of `Machine` (supervisor/core/machine.py), which inherits it.
"""

from __future__ import annotations

from supervisor.core.context import CANARY_TRIES, PROBE_RETRY_DELAY
from supervisor.core.events import (
    Action,
    CancelTimer,
    CheckIntent,
    NotifyReady,
    PortOpen,
    ProbeDone,
    ReadyLine,
    SetTimer,
    SpecCollapsed,
    StartProbe,
    Transitioned,
)
from supervisor.core.states import PROBED, ProbeKind, Reason, State, TimerName
from supervisor.core.upgrade_rules import UpgradeRules


class ProbeRules(UpgradeRules):
    """Up, ready, degraded or restarted, from what the launch shows (failures restart it)."""

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
        ctx.restarts.clear()
        return [
            self._change_profile(fallback),
            *self._restart(Reason.SPEC_COLLAPSE, now, event.detail),
        ]

    def _canary_unavailable(self, why: str, now: float) -> list[Action]:
        """The gate fails closed: ready only on evidence. A canary with no answer is asked
        again with the next readiness probe, CANARY_TRIES times in all, then the launch is
        restarted (an incident, counted towards the crash loop like any other)."""
        ctx = self.ctx
        ctx.canary_tries += 1
        detail = f"{why} ({ctx.canary_tries}/{CANARY_TRIES})"
        if ctx.canary_tries >= CANARY_TRIES:
            return self._restart(Reason.CANARY_UNAVAILABLE, now, detail)
        return [
            Transitioned(ctx.state, ctx.state, Reason.CANARY_UNAVAILABLE, detail),
            SetTimer(TimerName.PROBE_RETRY, PROBE_RETRY_DELAY, ctx.launch),
        ]

    def _probe_done(self, event: ProbeDone, now: float) -> list[Action]:
        ctx = self.ctx
        r = event.result
        if event.kind is ProbeKind.READINESS and ctx.state is State.WARMING:
            ccfg = self.cfg.quality.canary
            if r.ok and not ctx.compared:
                # Not judged before it is known whether the launch is a trial (LaunchCompared,
                # which comes long before a real load ends).
                return [SetTimer(TimerName.PROBE_RETRY, PROBE_RETRY_DELAY, ctx.launch)]
            if r.ok and event.canary_unavailable and ccfg.policy == "gate":
                return self._canary_unavailable(event.canary_unavailable, now)
            regression = self._gate_regression(event) if r.ok else None
            notes: list[Action] = []
            if regression is not None:
                acted = self._trial_regressed(*regression, now)
                if acted is not None:
                    return acted
                notes = self._alerted(*regression)
            elif r.ok and event.canary_mismatch and ccfg.policy == "gate":
                # Never ready on a wrong answer; counts towards the crash loop like any other
                # unrequested restart, so the fallback profile is tried.
                return self._restart(Reason.CANARY_MISMATCH, now, event.canary_mismatch)
            if r.ok:
                ctx.ready_at = now
                ctx.ever_ready = True
                ctx.canary_at = now
                return [
                    *notes,
                    *self._to(State.READY, "probe_ok", now, f"{r.completion_tokens} tokens"),
                    CancelTimer(TimerName.LOAD),
                    NotifyReady(),
                    SetTimer(TimerName.LIVENESS, self.cfg.liveness.interval, ctx.launch),
                    CheckIntent(ctx.launch, r),
                    *self._after_gate(event, now),
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
                if not event.canary_mismatch:
                    actions += self._maybe_promote(now)
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
