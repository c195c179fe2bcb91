"""The multi-node group's verdicts, as pure functions of the machine's state and the peers'
views (docs/multinode.md); `group` polls the peers and acts on them. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.core.states import CHILD_STATES, SERVING, State

# ------------------------------------------------------------------------ multi-node group


@dataclass(frozen=True)
class PeerView:
    """One peer's GET /group, as seen by a poll; None fields when it did not answer."""

    epoch: str | None  # the leader's epoch the peer runs (leader: its own current one)
    state: str | None  # the peer's machine state
    running: bool  # the peer has a process of that epoch's launch
    ready: bool  # the peer's own readiness (leader: the decode probe)


def epoch_running(state: State) -> bool:
    """A launch of this node is under way or serving: the epoch is live here."""
    return state in CHILD_STATES


def leader_ends(
    epoch: str,
    state: State,
    peer: PeerView | None,
    joined: bool,
    unreachable_s: float,
    partition_timeout: float,
) -> str | None:
    """Leader: why its current epoch must end because of one follower, or None.

    `joined`: the follower has been seen running this epoch. A follower that joined and then
    shows another epoch or no process (its SGLang died, its daemon restarted) ends the epoch:
    a node cannot rejoin a running group, and the others would block in NCCL until SGLang's
    watchdog. A follower unreachable for `partition_timeout` ends it too (it ends its own).
    """
    if not epoch_running(state):
        return None
    if peer is not None and peer.state == State.FAILED.value:
        # It will not launch (an unfit GPU, its own crash loop): rank 0 would wait for it at
        # the rendezvous until load_timeout, or block in NCCL until SGLang's watchdog.
        return f"follower failed: it cannot take part in epoch {epoch}"
    if peer is None:
        # One that never joined is the load timeout's business (rank 0 waits for it).
        if joined and unreachable_s >= partition_timeout:
            return f"follower unreachable for {unreachable_s:.1f}s"
        return None
    if joined and (peer.epoch != epoch or not peer.running):
        return f"follower left epoch {epoch} (now {peer.epoch or 'none'}, state {peer.state})"
    return None


def follower_ends(
    my_epoch: str | None,
    state: State,
    leader: PeerView | None,
    unreachable_s: float,
    partition_timeout: float,
) -> str | None:
    """Follower: why its launch must end, or None. Never a reason to relaunch alone: after
    this the follower cleans and waits for the leader's next epoch (`follower_may_join`)."""
    if my_epoch is None or not epoch_running(state):
        return None
    if leader is None:
        if unreachable_s >= partition_timeout:
            return f"leader unreachable for {unreachable_s:.1f}s"
        return None
    if leader.epoch != my_epoch:
        return f"leader epoch {my_epoch} ended (now {leader.epoch or 'none'})"
    if not leader.running:
        return f"leader epoch {my_epoch} ended (leader {leader.state})"
    return None


def follower_failed_ends(state: State, leader: PeerView | None, told: str | None) -> str | None:
    """Follower in `failed`: the leader's running epoch it must end (each one once), or None.
    Whether or not it had joined: the leader's launch cannot complete without it."""
    if state is not State.FAILED or leader is None or leader.epoch is None:
        return None
    if not leader.running or leader.epoch == told:
        return None
    return leader.epoch


def follower_may_join(leader: PeerView | None, last_epoch: str | None) -> bool:
    """A follower launches only into the leader's current epoch while it is still starting
    (its rank 0 waits for the others at --dist-init-addr), and never into one it already ran."""
    if leader is None or leader.epoch is None or leader.epoch == last_epoch:
        return False
    return leader.running and not leader.ready


def group_ready(role: str, state: State, my_epoch: str | None, leader: PeerView | None) -> bool:
    """/readyz: the leader's own decode-verified state; a follower only while its processes
    live and the leader reports the same epoch ready."""
    if state not in SERVING:
        return False
    if role != "follower":
        return True
    return leader is not None and leader.ready and leader.epoch == my_epoch
