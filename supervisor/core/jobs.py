"""What a state means to the daemon's effects beyond the machine: whether systemd's start (or
stop) job is still running and must be extended, and which watchers of the launch a transition
ends. No I/O; machine.py re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.core.events import Transitioned
from supervisor.core.states import STARTUP_STATES, State

# Systemd's start job is extended by this much each time, while loading a 10-minute model.
EXTEND_BY_S = 30.0


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
