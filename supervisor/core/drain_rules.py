"""The machine's drain and router rules: `POST /drain` / `/undrain` (refusals and
transitions), and the `RouterRegister` / `RouterDeregister` actions added around every state
change and stop (`_with_router`). No I/O. A part of `Machine` (supervisor/core/machine.py), which
inherits it.
"""

from __future__ import annotations

from supervisor.core.context import MachineBase
from supervisor.core.events import Action, RouterDeregister, RouterRegister, StopChild, Transitioned
from supervisor.core.states import PROBED, SERVING, State


class DrainRules(MachineBase):
    """Drain, undrain, and keeping the router's worker list in step with the state."""

    def drain_refusal(self) -> str | None:
        """Why POST /drain cannot be honoured now (None: it can, or it is already draining)."""
        if self.ctx.state in PROBED:
            return None
        return f"nothing to drain: SGLang is not serving (state {self.ctx.state})"

    def undrain_needless(self) -> str | None:
        """Why an undrain has nothing to do (serving, not draining), or None."""
        if self.ctx.state in SERVING:
            return f"not draining: {self.ctx.state} and in the router's list as usual"
        return None

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
