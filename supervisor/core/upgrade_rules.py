"""The machine's trials and its last known good (LKG): what a launch is against the LKG of its
profile, how a trial is judged at its gate, when it becomes the LKG, what a regression does
(`quality.on_trial_regression`), and an operator's `upgrade accept|rollback`. No I/O. A part of
`Machine` (supervisor/core/machine.py), which inherits it through ProbeRules.

- `LaunchCompared` (the effect compares each launch with the LKG: interpreter, SGLang version,
  model files, argv, env) says whether the launch is a trial. The gate waits for it.
- A trial is judged at its readiness gate, idle, on the fixed prompts: its canary and known
  answers, its decode tokens/s against `trial_slowdown` x the LKG's and its accept length
  against `trial_accept_drop` x the LKG's, both measured the same way (the gate's best reading).
  A busy gate gives no speed verdict.
- A launch that passed its gate and served `trial_period` (ready) becomes its profile's LKG
  (`RecordLkg`). One that regressed under `alert` never does, short of `upgrade accept`.
- A rollback relaunches the LKG's command (rebuilt by the effect from a root-owned source; the
  comparison says when that is impossible, `rollback_refusal`). Without a verifiable LKG a
  wrong answer is the gate's ordinary `canary_mismatch` (the crash loop, the fallback profile,
  `failed`), and a slower trial (speed, accept length) serves, `regressed`, never promoted.
  Launches of the rolled-back profile stay on the LKG until a reload or `upgrade accept`; a
  crash-looping LKG gets the ordinary handling (the fallback profile, launched from the
  config, then `failed`), never the trial again.
- The trial's verdict at its gate: pass, regressed, or inconclusive when its speed was read
  while SGLang was busy (never a pass, never a regression).
"""

from __future__ import annotations

from typing import assert_never

from supervisor.config import PRIMARY
from supervisor.config.settings import TrialAction
from supervisor.core.events import (
    Action,
    LaunchCompared,
    ProbeDone,
    RecordLkg,
    RestartRequested,
    RolledBack,
    Transitioned,
    UpgradeChanged,
    UpgradeOp,
    UpgradeRequested,
)
from supervisor.core.restart_rules import RestartRules
from supervisor.core.states import (
    SERVING,
    Reason,
    Regression,
    State,
    TrialVerdict,
    UpgradeState,
)

# What a trial's wrong answer is: the gate's ordinary canary_mismatch when it cannot be rolled back.
CONTENT = frozenset({Regression.CANARY, Regression.KNOWN_ANSWERS})


def _accept_bound(event: ProbeDone, accept: float) -> float:
    """The highest accept length the gate's answer is consistent with: a short answer's
    tokens per verify step are coarse (8 tokens in 3 steps read 2.67, in 4 steps 2.0), so a
    trial is judged on one verify step fewer than it took. Speculation that accepts nothing
    (8 tokens in 8 steps: at most 1.14) still reads as what it is."""
    tokens, steps = event.result.completion_tokens, event.result.spec_verify_ct
    if tokens and steps and steps > 1:
        return max(accept, tokens / (steps - 1))
    return accept


class UpgradeRules(RestartRules):
    """The launch against the last known good: compared, judged, promoted, rolled back."""

    # ------------------------------------------------------------------ the comparison

    def _compared(self, event: LaunchCompared) -> list[Action]:
        ctx = self.ctx
        ctx.compared = True
        ctx.has_lkg = event.has_lkg
        ctx.lkg_tps, ctx.lkg_accept = event.lkg_tps, event.lkg_accept
        ctx.rollback_refusal = event.refusal
        ctx.trial = event.has_lkg and bool(event.differs) and not ctx.on_lkg
        if ctx.on_lkg:
            return self._upgrade_is(UpgradeState.ROLLED_BACK, ctx.upgrade_why)
        if ctx.trial:
            return self._upgrade_is(UpgradeState.TRIAL, "differs: " + "; ".join(event.differs))
        if ctx.upgrade is UpgradeState.ACCEPTED:
            return self._upgrade_is(UpgradeState.ACCEPTED, ctx.upgrade_why)
        why = "" if event.has_lkg else "no last known good yet"
        return self._upgrade_is(UpgradeState.NONE, why)

    def _upgrade_is(self, state: UpgradeState, why: str) -> list[Action]:
        self.ctx.upgrade, self.ctx.upgrade_why = state, why
        return [UpgradeChanged(state, self.ctx.trial, why)]

    # ------------------------------------------------------------------ the gate

    def _judged(self) -> bool:
        """Whether the launch is judged against the last known good at its gate."""
        ctx = self.ctx
        return ctx.trial and ctx.has_lkg and not ctx.accept_next and not ctx.on_lkg

    def _gate_regression(self, event: ProbeDone) -> tuple[Regression, str] | None:
        """How a judged trial regressed at its gate, or None; its verdict is kept
        (/status.upgrade.trial.verdict)."""
        if not self._judged():
            return None
        found = self._regression(event)
        if found is not None:
            self.ctx.verdict = TrialVerdict.REGRESSED
        elif event.busy:
            # Its speed read under load says nothing about the trial: no pass either.
            self.ctx.verdict = TrialVerdict.INCONCLUSIVE
        else:
            self.ctx.verdict = TrialVerdict.PASS
        return found

    def _regression(self, event: ProbeDone) -> tuple[Regression, str] | None:
        ctx, q = self.ctx, self.cfg.quality
        if event.canary_mismatch:
            kind = Regression.KNOWN_ANSWERS if event.known_failed else Regression.CANARY
            return kind, event.canary_mismatch
        tps, lkg_tps = event.gate_tps, ctx.lkg_tps
        if (
            q.trial_slowdown
            and lkg_tps
            and tps is not None
            and not event.busy
            and tps < q.trial_slowdown * lkg_tps
        ):
            return Regression.SPEED, (
                f"decode {tps:.1f} tokens/s at the gate, below {q.trial_slowdown:g} x the "
                f"last known good's {lkg_tps:.1f}"
            )
        accept, lkg_accept = event.gate_accept, ctx.lkg_accept
        if (
            q.trial_accept_drop
            and accept is not None
            and not event.busy
            and lkg_accept is not None
            and _accept_bound(event, accept) < q.trial_accept_drop * lkg_accept
        ):
            return Regression.ACCEPT_LENGTH, (
                f"accept length {accept:.2f} at the gate, below {q.trial_accept_drop:g} x "
                f"the last known good's {lkg_accept:.2f}"
            )
        return None

    def _trial_regressed(self, kind: Regression, why: str, now: float) -> list[Action] | None:
        """What a regressed trial does (quality.on_trial_regression); None: it goes ready all
        the same, never promoted (`alert`, reported; `rollback` refused on speed or accept
        length, `regressed`)."""
        ctx = self.ctx
        policy = TrialAction(self.cfg.quality.on_trial_regression)
        detail = f"{kind}: {why}"
        match policy:
            case TrialAction.ALERT:
                ctx.regressed = True
                return None
            case TrialAction.ROLLBACK if ctx.rollback_refusal is not None:
                # No verifiable last known good to go back to: a wrong answer is the gate's
                # ordinary one (counted towards the crash loop: the fallback profile, then
                # `failed`); a slower trial serves, said loudly (`regressed`).
                cannot = f"{detail}; cannot roll back: {ctx.rollback_refusal}"
                if kind in CONTENT and self.cfg.quality.canary.policy == "gate":
                    return [
                        *self._upgrade_is(UpgradeState.TRIAL, f"regressed ({cannot})"),
                        *self._restart(Reason.CANARY_MISMATCH, now, cannot),
                    ]
                ctx.regressed = True
                return None
            case TrialAction.ROLLBACK:
                if self.cfg.restart.mode == "exit":
                    # A node of a multi-node group: the rollback is the group's decision, made
                    # by the orchestrator that relaunches it (docs/quality.md).
                    group = f"regressed ({detail}); the group decides"
                    return [
                        *self._upgrade_is(UpgradeState.TRIAL, group),
                        *self._restart(Reason.TRIAL_REGRESSED, now, detail),
                    ]
                return [
                    *self._roll_back(kind, why),
                    *self._restart(Reason.TRIAL_REGRESSED, now, detail),
                ]
            case TrialAction.HOLD:
                ctx.holding = True
                return [
                    *self._upgrade_is(UpgradeState.HELD, detail),
                    *self._restart(Reason.TRIAL_REGRESSED, now, detail),
                ]
            case _:
                assert_never(policy)

    def _roll_back(self, kind: Regression, why: str) -> list[Action]:
        """From now on the last known good is launched, until a reload or `upgrade accept`."""
        ctx = self.ctx
        ctx.on_lkg, ctx.trial, ctx.accept_next = True, False, False
        ctx.rolled_back = ctx.profile
        return [
            RolledBack(ctx.launch, kind, why),
            *self._upgrade_is(UpgradeState.ROLLED_BACK, f"rolled back ({kind}): {why}"),
        ]

    def _crash_loop_rollback(self, detail: str) -> list[Action] | None:
        """A crash-looping trial is rolled back before the fallback profile is tried; None when
        there is nothing to roll back to."""
        ctx = self.ctx
        possible = ctx.trial and ctx.has_lkg and ctx.rollback_refusal is None
        action = TrialAction(self.cfg.quality.on_trial_regression)
        if not possible or action is not TrialAction.ROLLBACK:
            return None
        ctx.restarts.clear()
        ctx.backoff = self.cfg.restart.backoff_initial
        return self._roll_back(Regression.CRASH_LOOP, detail)

    def _after_gate(self, event: ProbeDone, now: float) -> list[Action]:
        """A launch just went ready: its gate readings are kept for its promotion, which comes
        now (an operator accepted it), at its first good liveness probe after
        quality.trial_period, or never (it regressed)."""
        ctx = self.ctx
        ctx.gate_tps, ctx.gate_accept = event.gate_tps, event.gate_accept
        if ctx.accept_next:
            ctx.accept_next = False
            return self._promote("accepted by an operator")
        ctx.awaiting_lkg = not (ctx.on_lkg or ctx.regressed or (ctx.has_lkg and not ctx.trial))
        return []

    def _maybe_promote(self, now: float) -> list[Action]:
        """An OK liveness probe while `ready`: the launch becomes the last known good once it
        has served quality.trial_period since its gate (no timer: a launch degraded or drained
        at that moment is promoted at its next good probe, and the clock survives a
        hand-over because `ready_at` does)."""
        ctx = self.ctx
        if not ctx.awaiting_lkg or ctx.state is not State.READY or ctx.ready_at is None:
            return []
        period = self.cfg.quality.trial_period
        if now - ctx.ready_at < period:
            return []
        return self._promote(f"served {period:g}s")

    def _promote(self, how: str) -> list[Action]:
        ctx = self.ctx
        ctx.trial, ctx.has_lkg, ctx.regressed, ctx.awaiting_lkg = False, True, False, False
        ctx.lkg_tps, ctx.lkg_accept = ctx.gate_tps, ctx.gate_accept
        ctx.lkgs[ctx.profile] = (ctx.gate_tps, ctx.gate_accept)
        return [
            RecordLkg(ctx.launch, ctx.profile, ctx.gate_tps, ctx.gate_accept),
            *self._upgrade_is(UpgradeState.ACCEPTED, f"the last known good ({how})"),
        ]

    # ------------------------------------------------------------------ asked by an operator

    def upgrade_refusal(self, op: UpgradeOp) -> str | None:
        """Why `kimi-serve upgrade accept|rollback` is refused now, or None."""
        ctx = self.ctx
        if ctx.state in (State.STOPPING, State.STOPPED):
            return "the daemon is stopping"
        if op is UpgradeOp.ROLLBACK:
            if ctx.profile != PRIMARY:
                # The rollback's relaunch is on primary (a manual restart): its own LKG is
                # what would run, not this profile's.
                return (
                    f"on the fallback profile {ctx.profile}: `kimi-serve restart` goes back "
                    "to primary first"
                )
            if not ctx.has_lkg:
                return f"there is no last known good for profile {ctx.profile}"
            if ctx.rollback_refusal is not None:
                return f"cannot roll back: {ctx.rollback_refusal}"
            if ctx.on_lkg:
                return "the last known good is what runs already"
            if not ctx.trial and ctx.upgrade is not UpgradeState.HELD:
                return "the launch is the last known good already"
            return None
        if ctx.rolled_back is not None or ctx.upgrade is UpgradeState.HELD:
            return None
        if ctx.trial and ctx.state in SERVING:
            return None
        return "nothing to accept: no trial serves, and no rollback or hold is in force"

    def _upgrade_requested(self, event: UpgradeRequested, now: float) -> list[Action]:
        ctx = self.ctx
        refused = self.upgrade_refusal(event.op)
        if refused is not None:
            return []
        manual = RestartRequested(Reason.MANUAL)
        if event.op is UpgradeOp.ROLLBACK:
            return [*self._roll_back(Regression.MANUAL, "requested"), *self._requested(manual, now)]
        if ctx.trial and ctx.state in SERVING and ctx.rolled_back is None:
            return self._promote("accepted by an operator")
        # Rolled back or held: the config is launched again and taken as it is once ready.
        ctx.on_lkg, ctx.accept_next, ctx.holding = False, True, False
        ctx.rolled_back = None
        note = "accepted by an operator: the config is launched again"
        return [*self._upgrade_is(UpgradeState.NONE, note), *self._requested(manual, now)]

    def _reloaded(self) -> bool:
        """A reload ends a rollback or a hold: the config is a new trial. True when one was in
        force (then even an unchanged config is launched again)."""
        ctx = self.ctx
        was = ctx.rolled_back is not None or ctx.upgrade is UpgradeState.HELD
        ctx.on_lkg = ctx.accept_next = ctx.regressed = False
        ctx.rolled_back = None
        return was

    def _alerted(self, kind: Regression, why: str) -> list[Action]:
        """A regression served, not acted on: ready all the same. With on_trial_regression
        alert it is reported; with rollback (refused: no verifiable last known good) the trial
        is `regressed`, saying why it serves."""
        ctx = self.ctx
        state, detail = ctx.state, f"{kind}: {why}"
        policy = TrialAction(self.cfg.quality.on_trial_regression)
        if policy is TrialAction.ROLLBACK and ctx.rollback_refusal is not None:
            why_served = f"{detail}; served: cannot roll back: {ctx.rollback_refusal}"
            return [
                Transitioned(state, state, Reason.TRIAL_REGRESSED, why_served),
                *self._upgrade_is(UpgradeState.REGRESSED, why_served),
            ]
        return [
            Transitioned(state, state, Reason.TRIAL_REGRESSED, detail),
            *self._upgrade_is(UpgradeState.TRIAL, f"regressed ({detail}); reported only"),
        ]
