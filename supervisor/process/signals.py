"""The one way kimi-serve signals a set of processes: identity-checked terminate.

SIGTERM (when a grace is given), wait the grace, SIGKILL what is left, wait until it is gone.
Every signal is preceded by a (pid, create time) check (`identity.live_process`, one tolerance
for the whole project), so a pid reused by some other process is never signalled. Cleaning
before a launch, stopping a launch's escapees and `kimi-serve gpu-clean` all come here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from supervisor.process.identity import (
    ProcessIdentity,
    identity_of,
    live_process,
    same_start,
    signal_identity,
)


@dataclass
class Terminated:
    notes: dict[int, str] = field(default_factory=dict)  # pid -> what was done to it
    alive: list[ProcessIdentity] = field(default_factory=list)  # still there at the deadline


def send(ident: ProcessIdentity, sig: signal.Signals) -> str:
    """Signal only the very process named (pid and create time); say what happened."""
    if signal_identity(ident, sig):
        return sig.name
    now = identity_of(ident.pid)
    if now is None:
        return "already gone"
    if not same_start(now.create_time, ident.create_time):
        return "not signalled: the pid now names another process"
    if live_process(ident) is None:
        return "already gone (zombie)"
    return "not signalled: permission denied"


async def wait_gone(
    idents: Iterable[ProcessIdentity],
    timeout: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    poll: float = 0.005,
) -> list[ProcessIdentity]:
    """Those of `idents` still alive (not zombies) after `timeout` seconds, or none sooner.

    These are mostly not our children: no SIGCHLD, and no event for another process's exit
    short of a pidfd each, so poll against the deadline. A zombie counts as gone: it has
    released its GPU memory (docs/sglang.md, "GPU memory").
    """
    targets = list(idents)
    deadline = clock() + timeout
    while True:
        alive = [i for i in targets if live_process(i) is not None]
        if not alive or clock() >= deadline:
            return alive
        await asyncio.sleep(poll)


async def terminate(
    identities: Iterable[ProcessIdentity],
    *,
    grace: float | None = None,
    kill_wait: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    poll: float = 0.005,
) -> Terminated:
    """SIGTERM + `grace` (unless None), SIGKILL, then wait up to `kill_wait` for them to go.

    With a grace, only the processes the SIGTERM reached are sent SIGKILL (the others are gone
    or not ours to signal). Our own pid is never a target.
    """
    targets = sorted(i for i in set(identities) if i.pid != os.getpid())
    out = Terminated()
    if grace is not None:
        reached = []
        for ident in targets:
            out.notes[ident.pid] = send(ident, signal.SIGTERM)
            if out.notes[ident.pid] == signal.SIGTERM.name:
                reached.append(ident)
        to_kill = await wait_gone(reached, grace, clock=clock, poll=poll)
    else:
        to_kill = targets
    for ident in to_kill:
        note = send(ident, signal.SIGKILL)
        out.notes[ident.pid] = f"{out.notes[ident.pid]}, {note}" if ident.pid in out.notes else note
    if kill_wait > 0:
        out.alive = await wait_gone(to_kill, kill_wait, clock=clock, poll=poll)
    return out
