"""How long users were without this replica, per restart nobody asked for. Pure.

From the moment the state leaves `ready` (to `degraded` or `restarting`) until it is `ready`
again, when an unrequested restart (not `manual`, not `reload`) came in between: the
`kimi_serve_restart_downtime_seconds` histogram and `/status.last_restart.downtime_s`. Restarts
that follow each other before the replica is ready again (a crash loop) are one downtime. A
replica that was drained on purpose (`draining`) was not serving by request: its restart
starts no downtime; neither does a stop.
"""

from __future__ import annotations

from supervisor.core.machine import Reason, State, Transitioned

REQUESTED = frozenset({Reason.MANUAL.value, Reason.RELOAD.value})


class Downtime:
    def __init__(self) -> None:
        self.left_ready_at: float | None = None
        self.unrequested = False  # an unrequested restart since leaving ready
        self.requested = False  # ... or one somebody asked for (then it is not counted)

    def transitioned(self, t: Transitioned, now: float) -> float | None:
        """The downtime that just ended (at `ready` again), else None."""
        if t.old is State.READY and t.new is not State.READY:
            self.left_ready_at, self.unrequested, self.requested = now, False, False
        if self.left_ready_at is None:
            return None
        if t.new is State.RESTARTING and t.old is not State.RESTARTING:
            if t.reason in REQUESTED:
                self.requested = True
            else:
                self.unrequested = True
        if t.new in (State.STOPPING, State.STOPPED, State.DRAINING):
            self.left_ready_at = None
            return None
        if t.new is State.READY:
            start, self.left_ready_at = self.left_ready_at, None
            if self.unrequested and not self.requested:
                return max(0.0, now - start)
        return None
