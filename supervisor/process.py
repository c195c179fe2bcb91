"""Owning SGLang's processes: spawn, pump output, notice death, stop, sweep.

- SGLang runs in a session (and process group) of its own, so one killpg reaches the scheduler
  and detokenizer children (docs/sglang.md, "Processes"; `SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION`
  relies on it).
- Death is noticed through a pidfd on the event loop: no polling delay, no thread. asyncio's own
  `Process.wait()` is not used because it only returns once every pipe is closed, and SGLang's
  children inherit its stdout: an orphaned scheduler would hide the main process's death.
- Children that escape the group (a child still loading sets PR_SET_PDEATHSIG only later,
  sglang #23627) are found by their recorded (pid, create time) and by an environment marker
  every process of ours inherits; both are checked before any signal (`signals.terminate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import psutil

from supervisor import signals
from supervisor.identity import (
    OWNER_ENV,
    ProcessIdentity,
    descendants,
    identity_of,
    live_process,
    signal_identity,
)
from supervisor.logscan import Stream

LAUNCH_ENV = "KIMI_SERVE_LAUNCH"
_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20  # room for a burst of log lines while the loop is busy elsewhere
_READ_CHUNK = 1 << 16
# After SIGKILL a process is gone within milliseconds (a few seconds for a large CUDA context);
# one still there after this is stuck in the kernel.
STUCK_AFTER_KILL_S = 30.0

LineSink = Callable[[int, Stream, list[str]], None]


@dataclass
class ExitInfo:
    exit_code: int | None
    signal: int | None
    # Processes of the launch still alive after SIGKILL: stuck in the kernel (D state, inside
    # the GPU driver). No signal reaches them; relaunching on their GPUs is pointless.
    stuck: tuple[int, ...] = ()


@dataclass
class Child:
    """One launch of SGLang and what we know of its process tree."""

    launch: int
    popen: subprocess.Popen[bytes]
    identity: ProcessIdentity
    started_at: float  # unix time, for status and kimi_serve_child_start_time_seconds
    known: set[ProcessIdentity] = field(default_factory=set)
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    # Set to cut a graceful stop's drain short (a second SIGTERM while draining).
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    stop_begun: bool = False
    stop_done: bool = False  # every process of the launch gone (or stuck), pipes closed
    pipes_closed: asyncio.Event = field(default_factory=asyncio.Event)
    exit: ExitInfo | None = None
    _open_pipes: int = 2

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.exit is None


async def wait_port_open(host: str, port: int, interval: float = 0.1) -> None:
    """Returns once a TCP connect to host:port succeeds."""
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(interval)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


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

    def close(self) -> None:
        if self.fd < 0:
            return
        asyncio.get_running_loop().remove_reader(self.fd)
        if self.partial:
            self.sink(self.child.launch, self.stream, [self.partial.decode("utf-8", "replace")])
            self.partial = b""
        os.close(self.fd)
        self.fd = -1
        self.child._open_pipes -= 1
        if self.child._open_pipes <= 0:
            self.child.pipes_closed.set()


def _ignore_lines(_launch: int, _stream: Stream, _lines: list[str]) -> None:
    pass


def _ignore_exit(_child: Child) -> None:
    pass


class ProcessOwner:
    """Spawns and stops SGLang; the only code that sends signals to it."""

    def __init__(
        self,
        owner: str,
        sink: LineSink = _ignore_lines,
        on_exit: Callable[[Child], None] = _ignore_exit,
    ) -> None:
        self.owner = owner
        self.sink = sink
        self.on_exit = on_exit
        self._pumps: dict[int, list[_Pump]] = {}

    def bind(self, sink: LineSink, on_exit: Callable[[Child], None]) -> None:
        """Where SGLang's lines and its exit go (the daemon's log pump and its queue)."""
        self.sink = sink
        self.on_exit = on_exit

    def hurry(self, child: Child) -> None:
        """A stop is draining: stop waiting, SIGKILL the group now; the running stop finishes."""
        child.hurry.set()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)

    def spawn(
        self,
        launch: int,
        argv: Iterable[str],
        env_add: Mapping[str, str],
        workdir: str | None,
    ) -> Child:
        """Start SGLang. Raises OSError (e.g. no such interpreter) with the reason."""
        env = dict(os.environ)
        # Our own notify socket belongs to us: SGLang must not talk to systemd in our name.
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS"):
            env.pop(name, None)
        env.update(env_add)
        env[OWNER_ENV] = self.owner
        env[LAUNCH_ENV] = f"{os.getpid()}-{launch}"
        env.setdefault("PYTHONUNBUFFERED", "1")
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=workdir,
            start_new_session=True,
            close_fds=True,
        )
        ident = identity_of(popen.pid) or ProcessIdentity(popen.pid, time.time())
        child = Child(
            launch=launch,
            popen=popen,
            identity=ident,
            started_at=time.time(),
            known={ident},
        )
        assert popen.stdout is not None and popen.stderr is not None
        pumps = []
        for stream, pipe in ((Stream.STDOUT, popen.stdout), (Stream.STDERR, popen.stderr)):
            fd = os.dup(pipe.fileno())
            pipe.close()
            _set_nonblocking(fd)
            _grow_pipe(fd)
            pumps.append(_Pump(child, stream, fd, self.sink))
        self._pumps[launch] = pumps
        self._watch_exit(child)
        return child

    def _watch_exit(self, child: Child) -> None:
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(child.pid)
        except OSError:
            # Kernel without pidfd (< 5.3): a thread blocked in waitpid is the fallback.
            loop.run_in_executor(None, child.popen.wait).add_done_callback(
                lambda _f: self._reaped(child)
            )
            return

        def readable() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            child.popen.wait()
            self._reaped(child)

        loop.add_reader(pidfd, readable)

    def _reaped(self, child: Child) -> None:
        rc = child.popen.returncode
        child.exit = ExitInfo(
            exit_code=rc if rc is not None and rc >= 0 else None,
            signal=-rc if rc is not None and rc < 0 else None,
        )
        child.exited.set()
        self.on_exit(child)

    def refresh_tree(self, child: Child) -> bool:
        """Record descendants seen now. True if something new was recorded."""
        if not child.alive():
            return False
        new = set(descendants(child.pid)) - child.known
        child.known |= new
        return bool(new)

    def marked_processes(self) -> list[ProcessIdentity]:
        """Live processes carrying our owner marker (from any launch, any daemon run)."""
        found = []
        me = os.getpid()
        for proc in psutil.process_iter(["pid"]):
            if proc.pid == me:
                continue
            with contextlib.suppress(psutil.Error, OSError):
                if proc.environ().get(OWNER_ENV) == self.owner:
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        continue
                    found.append(ProcessIdentity(proc.pid, proc.create_time()))
        return found

    async def stop(self, child: Child, graceful: bool, drain_timeout: float) -> ExitInfo:
        """Stop the launch: SIGTERM + drain (if graceful), SIGKILL the group, sweep escapees.

        Returns once no process of the launch is alive, or once STUCK_AFTER_KILL_S has passed
        with some still there (stuck in the kernel; listed in ExitInfo.stuck).
        """
        child.stop_begun = True
        self.refresh_tree(child)
        if graceful and child.alive() and not child.hurry.is_set():
            signal_identity(child.identity, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_timeout):
                    await _first(child.exited, child.hurry)
        self.refresh_tree(child)
        # The group outlives its leader while members exist, and Linux does not reuse a pid
        # that still names a process group, so this reaches only our launch.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        await self.sweep(child.known | set(self.marked_processes()))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STUCK_AFTER_KILL_S):
                await child.exited.wait()
        # Pipes close once every writer is dead; a writer we could not find must not hang us.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await child.pipes_closed.wait()
        for pump in self._pumps.pop(child.launch, []):
            pump.close()
        stuck = tuple(i.pid for i in self.survivors(child))
        child.stop_done = True
        if child.exit is None:
            return ExitInfo(None, None, stuck or (child.pid,))
        return ExitInfo(child.exit.exit_code, child.exit.signal, stuck)

    async def sweep(
        self,
        identities: Iterable[ProcessIdentity],
        grace: float | None = None,
        timeout: float = 5.0,
    ) -> list[ProcessIdentity]:
        """Kill the listed processes (identity-checked): SIGTERM first when a grace is given.

        Returns those still alive at the deadline (stuck in D state: beyond any signal).
        """
        done = await signals.terminate(identities, grace=grace, kill_wait=timeout)
        return done.alive

    def survivors(self, child: Child) -> list[ProcessIdentity]:
        return [i for i in child.known if live_process(i) is not None]


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
