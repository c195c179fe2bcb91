"""The main process's side of its children: spawn, watch, kill.

SGLang's main process starts one scheduler per TP rank and a detokenizer at the start of
loading, before anything listens (sglang/srt/entrypoints/engine.py, _launch_subprocesses), and
on every exit path kills its whole tree (sglang/srt/utils, kill_process_tree).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

DETOKENIZER = "sglang::detokenizer"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def scheduler_role(rank: int, tp_size: int) -> str:
    """sglang/srt/managers/scheduler.py:6294: the `_TP<rank>` suffix only when tp > 1."""
    return f"sglang::scheduler_TP{rank}" if tp_size > 1 else "sglang::scheduler"


@dataclasses.dataclass(frozen=True)
class ChildOptions:
    orphan: bool = False
    ignore_sigterm: bool = False
    lifetime: float = 600.0


@dataclasses.dataclass(frozen=True)
class Death:
    role: str
    pid: int
    returncode: int


class Children:
    def __init__(self) -> None:
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._reported: set[int] = set()
        self._ready_fd: int | None = None
        self._ready = 0

    def spawn(self, tp_size: int, options: ChildOptions, detokenizer: bool = True) -> None:
        """Start the schedulers and the detokenizer.

        Must run on the main thread: PR_SET_PDEATHSIG fires when the thread that forked the
        child exits, not the process.
        """
        env = dict(os.environ)
        # The children import this package the way the main process did, whatever the cwd.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p
        )
        # Each child writes one byte here once it is set up, like the pipe on which SGLang's
        # schedulers report {"status": "ready"} to _launch_subprocesses.
        self._ready_fd, ready_w = os.pipe()
        os.set_blocking(self._ready_fd, False)
        flags = ["--parent-pid", str(os.getpid()), "--ready-fd", str(ready_w)]
        if options.orphan:
            flags += ["--orphan", "--lifetime", str(options.lifetime)]
        if options.ignore_sigterm:
            flags.append("--ignore-sigterm")
        # Ranks >= 1 of a multi-node group run schedulers only (entrypoints/engine.py:1234).
        roles = [scheduler_role(r, tp_size) for r in range(tp_size)]
        for role in [*roles, *([DETOKENIZER] if detokenizer else [])]:
            argv = [sys.executable, "-m", "supervisor.standin.child", *flags, "--role", role]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env, pass_fds=(ready_w,))
            self._procs.append((role, proc))
        os.close(ready_w)

    @property
    def all_ready(self) -> bool:
        """Whether every child has reported that it is set up."""
        if self._ready_fd is not None and self._ready < len(self._procs):
            with contextlib.suppress(BlockingIOError):
                self._ready += len(os.read(self._ready_fd, 4096))
        return self._ready >= len(self._procs)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for _, proc in self._procs]

    def alive(self) -> list[str]:
        """The roles of the children still running."""
        return [role for role, proc in self._procs if proc.poll() is None]

    def newly_dead(self) -> list[Death]:
        """Children that exited since the last call (each reported once)."""
        deaths = []
        for role, proc in self._procs:
            code = proc.poll()
            if code is not None and proc.pid not in self._reported:
                self._reported.add(proc.pid)
                deaths.append(Death(role, proc.pid, code))
        return deaths

    def kill_all(self) -> None:
        for _, proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGKILL)
        for _, proc in self._procs:
            # A child stuck in the kernel (D state) cannot be helped by waiting longer.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
