"""What the admin endpoint asks of the daemon (admin.AdminBackend, router.DrainHost): `/livez`,
`/readyz`, `/metrics`, `/status` and the operations' verdicts, each asked of the machine and
queued (restart, upgrade) or dispatched (drain, undrain: the deregistration must have begun
when `/drain` awaits it). A part of `Daemon` (daemon/loop.py), which inherits it and sets
every attribute below."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from supervisor.core import events as ev
from supervisor.core.machine import Machine
from supervisor.core.states import Reason
from supervisor.daemon.group import Group
from supervisor.daemon.handover import Handover
from supervisor.daemon.inbox import Item
from supervisor.daemon.launcher import Launcher
from supervisor.daemon.observed import Observed
from supervisor.daemon.upgrades import Upgrades
from supervisor.metrics import Metrics

# /livez fails when the loop has not turned for this long.
LOOP_STALE_S = 5.0


class AdminAnswers:
    machine: Machine
    launcher: Launcher
    group: Group | None
    metrics: Metrics
    observed: Observed
    handover: Handover
    upgrades: Upgrades
    clock: Callable[[], float]
    _preparing: bool
    _beat: float

    def emit(self, item: Item) -> None:
        raise NotImplementedError  # the daemon's: queued for the loop

    def dispatch(self, item: Item) -> None:
        raise NotImplementedError  # the daemon's: handled now

    def loop_healthy(self) -> bool:
        # Preflight awaits its checks on the loop, with no event to dispatch: the loop that
        # answers /livez meanwhile is the proof it runs.
        return self._preparing or self.clock() - self._beat < LOOP_STALE_S

    def is_ready(self) -> bool:
        child = self.launcher.child
        dying = child is not None and child.dying  # a worker died: the end is being reported
        return self.machine.ready(dying, None if self.group is None else self.group.ready())

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def request_restart(self) -> str | None:
        refused = self.machine.refuse_restart()
        if refused is None:
            self.emit(ev.RestartRequested(Reason.MANUAL))
        return refused

    def request_upgrade(self, op: str) -> str | None:
        """POST /upgrade/accept|rollback: None when queued, else why it is refused."""
        upgrade = ev.UpgradeOp(op)
        refused = self.machine.upgrade_refusal(upgrade)
        if refused is None:
            self.emit(ev.UpgradeRequested(upgrade))
        return refused

    def next_launch(self) -> int:
        # The request is queued; the launch it makes comes after every one made so far.
        return self.machine.ctx.launch + 1

    def request_drain(self) -> str | None:
        # Dispatched here, not queued: the deregistration must have begun when /drain awaits it.
        refused = self.machine.drain_refusal()
        if refused is None:
            self.dispatch(ev.DrainRequested())
        return refused

    def request_undrain(self) -> tuple[str | None, str | None]:
        """(why it is refused, what makes it needless): both None when it was done."""
        needless = self.machine.undrain_needless()
        if needless is not None:
            return None, needless
        refused = self.machine.undrain_refusal()
        if refused is None:
            self.dispatch(ev.UndrainRequested())
        return refused, None

    def status_line(self) -> str:
        """STATUS=: world-readable, so the public line (Observed.status_line)."""
        return self.observed.status_line(public=True)

    def status_document(self) -> dict[str, Any]:
        return {
            **self.observed.status_document(),
            "daemon": self.handover.status(),
            "upgrade": self.upgrades.status_document(self.machine.ctx, self.clock()),
        }
