"""SGLang's worker processes, told by their command lines from anything else a launch runs,
and the exit status of a dead one (not our child: it cannot be waited for)."""

from __future__ import annotations

import os

import psutil

from supervisor.process.identity import ProcessIdentity, live_process

# SGLang's own processes of a launch, by command line: multiprocessing spawn children (before
# setproctitle runs), the resource tracker, and the titles SGLang sets (`sglang::scheduler`,
# `sglang::scheduler_TP3`, `sglang::detokenizer`, ...). Not a compiler or nvidia-smi a worker
# runs for a moment: those exit by design.
_WORKER_MARKS = ("multiprocessing.spawn", "multiprocessing.resource_tracker", "sglang::")


SPAWN_TITLE = "multiprocessing.spawn child"  # a worker before setproctitle ran in it


def worker_title(cmdline: list[str]) -> str | None:
    """A short name for an SGLang worker process, or None if the command line is not one."""
    joined = " ".join(a for a in cmdline if a)
    if not any(m in joined for m in _WORKER_MARKS):
        return None
    if cmdline and cmdline[0].startswith("sglang::"):
        return cmdline[0]
    if "resource_tracker" in joined:
        return "multiprocessing.resource_tracker"
    return SPAWN_TITLE


def exit_status_of_zombie(pid: int, proc_root: str = "/proc") -> tuple[int | None, int | None]:
    """(exit code, signal) of a process that is a zombie now, from /proc/PID/stat field 52.

    The exit of a process that is not our child cannot be waited for; until its parent reaps
    it the kernel still shows it. (None, None) once it is reaped or when it is not a zombie.
    """
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None, None
    fields = raw[raw.rfind(")") + 2 :].split()
    # fields[0] is field 3 (state); field 52 (exit_code, Linux 3.5+) is fields[49].
    if len(fields) < 50 or fields[0] != "Z" or not fields[49].lstrip("-").isdigit():
        return None, None
    status = int(fields[49])
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


def worker_of(ident: ProcessIdentity) -> tuple[str, int] | None:
    """(title, parent pid) of one of SGLang's workers; None for anything else.

    A fork that has not exec'd carries its parent's command line (`sglang::scheduler`, or
    the spawn line before setproctitle ran): a helper of that worker, never one SGLang
    spawned (multiprocessing's spawn context starts every worker as a new program).
    """
    proc = live_process(ident)
    if proc is None:
        return None
    try:
        cmdline = proc.cmdline()
        parent = proc.parent()
        title = worker_title(cmdline)
        if title is None or parent is None:
            return None
        if cmdline == parent.cmdline():
            return None
        return title, parent.pid
    except (psutil.Error, OSError):
        return None


def title_of(ident: ProcessIdentity) -> str | None:
    """The worker's title as its command line shows it now (setproctitle may have run)."""
    proc = live_process(ident)
    if proc is None:
        return None
    try:
        return worker_title(proc.cmdline())
    except (psutil.Error, OSError):
        return None
