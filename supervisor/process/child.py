"""One launch of SGLang as its owner sees it: its processes, how it ended, how far its stop came.

The stop's progress is one variable, `Child.phase` (a `ChildPhase`, moved forward only by
`Child.advance`): whether a stop was asked, whether its signals are out, whether it is over.
How the launch ended is data beside it: the first death reported (`exit`), the main process's
(`main_exit`), and a worker's death that is still being settled (`worker_death`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, assert_never

from supervisor.process.identity import ProcessIdentity


@dataclass
class ExitInfo:
    exit_code: int | None
    signal: int | None
    # Processes of the launch still alive after SIGKILL: stuck in the kernel (D state, inside
    # the GPU driver). No signal reaches them; relaunching on their GPUs is pointless.
    stuck: tuple[int, ...] = ()
    # Which process this exit is: "" for the main process, else a worker of SGLang's, e.g.
    # "sglang::scheduler (pid 4242)".
    process: str = ""


class Reapable(Protocol):
    """What the owner asks of SGLang's main process: a `Popen`, or one a hand-over adopted
    (process.adopt.Adopted: no Popen survives an exec, the child and its pid do)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self) -> int: ...


class ChildPhase(StrEnum):
    """How far the stop of a launch has come, in order."""

    RUNNING = "running"  # no stop asked
    # A stop is under way but has sent nothing yet (the router's deregistration settling, the
    # stacks taken before a kill): a process of the launch that dies now is still news.
    STOP_ASKED = "stop_asked"
    STOPPING = "stopping"  # signals are being sent: a death is the stop at work
    STOPPED = "stopped"  # every process of the launch gone (or stuck), pipes closed

    @property
    def signalled(self) -> bool:
        """Our signals reach the launch: a death is no news, and its tree is no longer
        recorded (what the stop kills is what it found)."""
        match self:
            case ChildPhase.RUNNING | ChildPhase.STOP_ASKED:
                return False
            case ChildPhase.STOPPING | ChildPhase.STOPPED:
                return True
            case _:
                assert_never(self)


_ORDER = tuple(ChildPhase)


@dataclass
class Child:
    """One launch of SGLang and what we know of its process tree."""

    launch: int
    popen: Reapable
    identity: ProcessIdentity
    started_at: float  # unix time, for status and kimi_serve_child_start_time_seconds
    known: set[ProcessIdentity] = field(default_factory=set)
    phase: ChildPhase = ChildPhase.RUNNING
    # Set once the main process is reaped.
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    # Set to cut a graceful stop's drain short (a second SIGTERM while draining).
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    pipes_closed: asyncio.Event = field(default_factory=asyncio.Event)
    # How the launch ended: the first of its processes to die (the main one or a worker), as
    # reported through on_exit. A worker's death while we stop the launch does not count.
    exit: ExitInfo | None = None
    main_exit: ExitInfo | None = None
    # The first worker's death that was news: readiness ends at once, and its report waits
    # MAIN_SETTLE_S for the main process's own exit, which would explain it.
    worker_death: ExitInfo | None = None
    # Workers watched by a pidfd: identity -> title, and -> the pid of its parent.
    watched: dict[ProcessIdentity, str] = field(default_factory=dict)
    parents: dict[ProcessIdentity, int] = field(default_factory=dict)
    _open_pipes: int = 2

    @property
    def pid(self) -> int:
        return self.popen.pid

    def advance(self, phase: ChildPhase) -> None:
        """On to `phase`, never back: a teardown's stop after one that was cut short stays
        where that one got to."""
        if _ORDER.index(phase) > _ORDER.index(self.phase):
            self.phase = phase

    @property
    def stop_begun(self) -> bool:
        return self.phase is not ChildPhase.RUNNING

    @stop_begun.setter
    def stop_begun(self, begun: bool) -> None:
        # How daemon.launcher marks the stop it starts: a stop is never taken back.
        if not begun:
            raise ValueError("a stop that has begun cannot be taken back")
        self.advance(ChildPhase.STOP_ASKED)

    @property
    def stop_done(self) -> bool:
        return self.phase is ChildPhase.STOPPED

    @property
    def dying(self) -> bool:
        """A worker died: readiness ends now, while the launch's end is being reported."""
        return self.worker_death is not None

    def alive(self) -> bool:
        """Every watched process of the launch is still there."""
        return self.exit is None and self.worker_death is None

    def main_alive(self) -> bool:
        return not self.exited.is_set()
