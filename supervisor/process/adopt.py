"""Taking over a launch of SGLang that an earlier exec of this daemon spawned (a hand-over).

An exec keeps the process, so SGLang's main process is still our child: it is reaped with
`waitpid` like any child, only without the `Popen` object the earlier program held. What is
checked before anything is adopted (`verify`), each a reason to fall back to an ordinary
restart: the same boot, the main process still our child, alive and the same process (start
time), every recorded worker the same process, every output pipe open and the same pipe
(inode) as the one handed over.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from supervisor.process.identity import ProcessIdentity, current_boot_id, live_process


class Adopted:
    """The part of `Popen` the owner uses, for a child this program did not spawn."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _reaped(self, status: int) -> int:
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already, by nobody of ours: status unknown
                self.returncode = -1
                return self.returncode
            if pid:
                return self._reaped(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                self.returncode = -1
                return self.returncode
            return self._reaped(status)
        return self.returncode


@dataclass(frozen=True)
class Pipe:
    """One output pipe as handed over: its descriptor, its inode, the partial line read."""

    fd: int
    inode: int
    partial: bytes


class Unverifiable(Exception):
    """The launch cannot be adopted; the message says why (logged, then an ordinary restart)."""


def pipe_inode(fd: int) -> int:
    return os.fstat(fd).st_ino


def verify(
    main: ProcessIdentity,
    boot_id: str | None,
    workers: Iterable[ProcessIdentity],
    pipes: Mapping[str, Pipe],
) -> None:
    """Raises Unverifiable naming the first thing that does not hold."""
    if boot_id is None or boot_id != current_boot_id():
        raise Unverifiable(f"the state is from another boot ({boot_id})")
    try:
        pid, status = os.waitpid(main.pid, os.WNOHANG)
    except ChildProcessError:
        raise Unverifiable(f"SGLang's main process {main.pid} is not our child") from None
    if pid:
        how = os.waitstatus_to_exitcode(status)
        raise Unverifiable(f"SGLang's main process {main.pid} ended during the exec ({how})")
    if live_process(main) is None:
        raise Unverifiable(f"process {main.pid} is not the SGLang process handed over")
    for ident in workers:
        if live_process(ident) is None:
            raise Unverifiable(f"SGLang's process {ident.pid} ended during the exec")
    for name, pipe in pipes.items():
        try:
            st = os.fstat(pipe.fd)
        except OSError:
            raise Unverifiable(f"SGLang's {name} pipe (fd {pipe.fd}) is closed") from None
        if not stat.S_ISFIFO(st.st_mode) or st.st_ino != pipe.inode:
            raise Unverifiable(f"fd {pipe.fd} is not SGLang's {name} pipe")
