"""`ProcessOwner`: spawns SGLang, watches every process of a launch, stops it, sweeps escapees.

The only code that sends signals to SGLang; what it knows of one launch is a `Child`
(process.child), its output goes through the pumps (process.pipes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping

import psutil

from supervisor import log
from supervisor.process import signals
from supervisor.process.child import Child, ChildPhase, ExitInfo
from supervisor.process.identity import (
    OWNER_ENV,
    ProcessIdentity,
    descendants,
    identity_of,
    launch_leader,
    live_process,
    session_members,
    signal_identity,
)
from supervisor.process.pipes import LineSink, _Pump, start_pump
from supervisor.process.workers import SPAWN_TITLE, exit_status_of_zombie, title_of, worker_of
from supervisor.sglang.logscan import Stream

LAUNCH_ENV = "KIMI_SERVE_LAUNCH"
# After SIGKILL a process is gone within milliseconds (a few seconds for a large CUDA context);
# one still there after this is stuck in the kernel.
STUCK_AFTER_KILL_S = 30.0

# SGLang's main process ends its workers before it exits (`kill_process_tree`,
# sglang/srt/utils/common.py): a worker's death is then seen a moment before the main exit
# that explains it. The report waits this long for the main process; readiness does not.
MAIN_SETTLE_S = 0.2


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
        self._worker_fds: dict[int, set[int]] = {}
        self._exit_fds: dict[int, int] = {}  # launch -> the pidfd on its main process

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
        fds = []
        for pipe in (popen.stdout, popen.stderr):
            fds.append(os.dup(pipe.fileno()))
            pipe.close()
        self.own(child, {Stream.STDOUT: (fds[0], b""), Stream.STDERR: (fds[1], b"")})
        return child

    def own(self, child: Child, pipes: Mapping[Stream, tuple[int, bytes]]) -> None:
        """Pump the launch's output pipes (each with the partial line already read) and watch
        its main process: a spawn's, or a hand-over's (process.adopt)."""
        pumps = [start_pump(child, s, fd, partial, self.sink) for s, (fd, partial) in pipes.items()]
        child._open_pipes = len(pumps)
        self._pumps[child.launch] = pumps
        self._watch_exit(child)

    def release(self, child: Child) -> dict[Stream, tuple[int, bytes]]:
        """The launch's pipes, no longer read, with their partial lines (a hand-over)."""
        pidfd = self._exit_fds.pop(child.launch, None)
        if pidfd is not None:
            asyncio.get_running_loop().remove_reader(pidfd)
            os.close(pidfd)
        return {p.stream: p.detach() for p in self._pumps.pop(child.launch, [])}

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
            self._exit_fds.pop(child.launch, None)
            loop.remove_reader(pidfd)
            os.close(pidfd)
            child.popen.wait()
            self._reaped(child)

        loop.add_reader(pidfd, readable)
        self._exit_fds[child.launch] = pidfd

    def _reaped(self, child: Child) -> None:
        rc = child.popen.returncode
        child.main_exit = ExitInfo(
            exit_code=rc if rc is not None and rc >= 0 else None,
            signal=-rc if rc is not None and rc < 0 else None,
        )
        child.exited.set()
        self._launch_ended(child, child.main_exit)

    def _launch_ended(self, child: Child, info: ExitInfo) -> None:
        # One report per launch: the first death is the one that explains the restart.
        if child.exit is not None:
            return
        child.exit = info
        self.on_exit(child)

    def _watch_worker(self, child: Child, ident: ProcessIdentity, title: str) -> None:
        """A pidfd on one of SGLang's worker processes: its death ends the launch at once."""
        try:
            pidfd = os.pidfd_open(ident.pid)
        except OSError:
            return  # already gone (the main process will follow), or no pidfd: main only
        if live_process(ident) is None:  # the pid was reused before the pidfd was opened
            os.close(pidfd)
            return
        loop = asyncio.get_running_loop()
        child.watched[ident] = title

        fds = self._worker_fds.setdefault(child.launch, set())

        def readable() -> None:
            fds.discard(pidfd)
            loop.remove_reader(pidfd)
            os.close(pidfd)
            self._worker_died(child, ident, title)

        loop.add_reader(pidfd, readable)
        fds.add(pidfd)

    def _worker_died(self, child: Child, ident: ProcessIdentity, title: str) -> None:
        if child.phase.signalled or child.exit is not None or child.worker_death is not None:
            return  # we are stopping it, or its end is already reported
        code, sig = exit_status_of_zombie(ident.pid)
        # PR_SET_PDEATHSIG: when the main process dies its workers are killed by the kernel,
        # after the main is already a zombie. Then the main's death is the one that happened.
        if child.popen.poll() is not None:
            if not child.exited.is_set():
                self._reaped(child)
            return
        title = child.watched.get(ident, title)  # as refresh_tree last named it
        parent = child.parents.get(ident)
        if parent is not None and parent != child.pid and sig is None and code in (0, None):
            # A child of a worker, not of SGLang's main process, that ended with status 0 or
            # was reaped at once by the worker that waited for it: a helper (`ldconfig -p`,
            # `lscpu`, caught between fork and exec with its parent's command line), not a
            # worker. A hang this leaves behind is the liveness probe's to find.
            log.get().info(
                "an SGLang helper process ended: not a death of the launch",
                process=f"{title} (pid {ident.pid})",
                exit_code=code,
                parent=parent,
            )
            return
        info = child.worker_death = ExitInfo(code, sig, process=f"{title} (pid {ident.pid})")
        asyncio.get_running_loop().create_task(self._settle(child, info))

    async def _settle(self, child: Child, info: ExitInfo) -> None:
        """Report a worker's death unless the main process's own exit follows at once."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(MAIN_SETTLE_S):
                await child.exited.wait()
        self._launch_ended(child, info)  # a no-op if the main process's exit came first

    def refresh_tree(self, child: Child) -> bool:
        """Record descendants seen now, and watch SGLang's workers among them.

        True if something new was recorded.
        """
        if not child.main_alive() or child.phase.signalled:
            return False
        new = set(descendants(child.pid)) - child.known
        child.known |= new
        for ident, seen in list(child.watched.items()):
            # First seen as a bare spawn child, before setproctitle named it: the name it has
            # now is the one a restart's detail must give (`sglang::scheduler`).
            if seen == SPAWN_TITLE:
                child.watched[ident] = title_of(ident) or seen
        if child.exit is None:
            for ident in sorted(new):
                found = worker_of(ident)
                if found is not None:
                    child.parents[ident] = found[1]
                    self._watch_worker(child, ident, found[0])
        return bool(new)

    def leftovers(self, recorded: Iterable[ProcessIdentity]) -> set[ProcessIdentity]:
        """Every live process of an earlier launch: the recorded ones, the members of its
        session (the launch's main process is the session leader), and the marked ones.

        The session is the evidence that survives setproctitle wiping a worker's environment
        (and with it the owner marker) and a worker that appeared after the record was saved.
        """
        recorded = set(recorded)
        found = {i for i in recorded if live_process(i) is not None}
        return found | self.evident(recorded)

    def evident(self, recorded: Iterable[ProcessIdentity]) -> set[ProcessIdentity]:
        """The processes of an earlier launch with evidence beyond the record's word: members
        of the session its main process led (the main process itself excepted: the record is
        what names it) and those carrying our owner marker, all of our uid."""
        leader = launch_leader(recorded)
        found = set(self.marked_processes())
        if leader is not None:
            found |= {i for i in session_members(leader) if i.pid != leader.pid}
        return found

    def marked_processes(self) -> list[ProcessIdentity]:
        """Live processes of our uid carrying our owner marker (any launch, any daemon run).
        Anyone can set the variable: another user's process is never ours."""
        found = []
        me, uid = os.getpid(), os.getuid()
        for proc in psutil.process_iter(["pid"]):
            if proc.pid == me:
                continue
            with contextlib.suppress(psutil.Error, OSError):
                if proc.environ().get(OWNER_ENV) == self.owner:
                    if proc.status() == psutil.STATUS_ZOMBIE or proc.uids().real != uid:
                        continue
                    found.append(ProcessIdentity(proc.pid, proc.create_time()))
        return found

    async def stop(self, child: Child, graceful: bool, drain_timeout: float) -> ExitInfo:
        """Stop the launch: SIGTERM + drain (if graceful), SIGKILL the group, sweep escapees.

        Returns once no process of the launch is alive, or once STUCK_AFTER_KILL_S has passed
        with some still there (stuck in the kernel; listed in ExitInfo.stuck).
        """
        child.advance(ChildPhase.STOP_ASKED)
        self.refresh_tree(child)
        # From here on a worker's death is the stop at work, not news.
        child.advance(ChildPhase.STOPPING)
        if graceful and child.main_alive() and not child.hurry.is_set():
            signal_identity(child.identity, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_timeout):
                    await _first(child.exited, child.hurry)
        if child.main_alive():
            child.known |= set(descendants(child.pid))
        # The group outlives its leader while members exist, and Linux does not reuse a pid
        # that still names a process group, so this reaches only our launch.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        members = session_members(child.identity)
        await self.sweep(child.known | set(members) | set(self.marked_processes()))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STUCK_AFTER_KILL_S):
                await child.exited.wait()
        # Pipes close once every writer is dead; a writer we could not find must not hang us.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await child.pipes_closed.wait()
        for pump in self._pumps.pop(child.launch, []):
            pump.close()
        self._close_worker_fds(child.launch)
        stuck = tuple(i.pid for i in self.survivors(child))
        child.advance(ChildPhase.STOPPED)
        # The exit as it was: the first death if the launch ended by itself, else the main's.
        ended = child.exit or child.main_exit
        if ended is None:
            return ExitInfo(None, None, stuck or (child.pid,))
        return ExitInfo(ended.exit_code, ended.signal, stuck, ended.process)

    def _close_worker_fds(self, launch: int) -> None:
        loop = asyncio.get_running_loop()
        for fd in self._worker_fds.pop(launch, set()):
            loop.remove_reader(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

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
