"""SGLang's stdout and stderr read on the loop: non-blocking, in batches, whole lines out."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Callable

from supervisor.process.child import Child
from supervisor.sglang.logscan import Stream

_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20  # room for a burst of log lines while the loop is busy elsewhere
_READ_CHUNK = 1 << 16
# After a short read the pump waits this long before it reads again, so a writer that writes
# line by line is read in batches, not with one wake-up of the loop per line. A full read goes
# on at once, so a fast writer is never left behind; 2 ms fill 2 % of the grown pipe at 100k
# lines/s (docs/benchmarks.md, "Log pump").
_SHORT_READ = 1 << 14
_READ_PAUSE_S = 0.002

LineSink = Callable[[int, Stream, list[str]], None]


def start_pump(child: Child, stream: Stream, fd: int, partial: bytes, sink: LineSink) -> _Pump:
    """Read `fd` (made non-blocking, grown) into `sink`, after the partial line `partial` a
    reader before this one left (a hand-over's; b"" for a spawn's)."""
    _set_nonblocking(fd)
    _grow_pipe(fd)
    reader = _Pump(child, stream, fd, sink)
    reader.partial = partial
    return reader


def _set_nonblocking(fd: int) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)


def _grow_pipe(fd: int) -> None:
    # Best effort: unprivileged users are capped by /proc/sys/fs/pipe-max-size.
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)


class _Pump:
    """Reads one pipe without ever blocking the writer for longer than the loop needs."""

    def __init__(self, child: Child, stream: Stream, fd: int, sink: LineSink) -> None:
        self.child = child
        self.stream = stream
        self.fd = fd
        self.sink = sink
        self.partial = b""
        self._resume: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, _READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        if len(data) < _SHORT_READ:
            loop = asyncio.get_running_loop()
            loop.remove_reader(self.fd)
            self._resume = loop.call_later(_READ_PAUSE_S, self._read_again)
        data = self.partial + data
        parts = data.split(b"\n")
        self.partial = parts.pop()
        if len(self.partial) > _READ_CHUNK:  # a line without end: deliver what we have
            parts.append(self.partial)
            self.partial = b""
        if parts:
            self.sink(
                self.child.launch,
                self.stream,
                [p.decode("utf-8", "replace").rstrip("\r") for p in parts],
            )

    def detach(self) -> tuple[int, bytes]:
        """Stop reading without closing: the descriptor and the partial line, for a hand-over
        (what is still in the pipe stays there for the next reader)."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self.fd >= 0:
            asyncio.get_running_loop().remove_reader(self.fd)
        fd, partial, self.fd = self.fd, self.partial, -1
        return fd, partial

    def _read_again(self) -> None:
        self._resume = None
        if self.fd >= 0:
            asyncio.get_running_loop().add_reader(self.fd, self._readable)

    def close(self) -> None:
        if self.fd < 0:
            return
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        asyncio.get_running_loop().remove_reader(self.fd)
        if self.partial:
            self.sink(self.child.launch, self.stream, [self.partial.decode("utf-8", "replace")])
            self.partial = b""
        os.close(self.fd)
        self.fd = -1
        self.child._open_pipes -= 1
        if self.child._open_pipes <= 0:
            self.child.pipes_closed.set()
