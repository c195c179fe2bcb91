"""Process scans by the owner marker every process the daemon launches inherits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import psutil

from supervisor.process.identity import OWNER_ENV
from testkit.wait import poll


def owned_processes(owner: str) -> list[psutil.Process]:
    """Live (non-zombie) processes that carry the daemon's owner marker."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(OWNER_ENV) == owner and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def kill_owned(owner: str) -> None:
    for proc in owned_processes(owner):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs: Iterable[psutil.Process], timeout: float = 10.0) -> list[psutil.Process]:
    """Those still alive (not zombies) after `timeout`, polled: an orphan nobody reaps is gone
    once it is a zombie, so a wait on its pid would wait out the whole timeout."""
    procs = list(procs)
    poll(lambda: not any(alive(p) for p in procs), timeout)
    return [p for p in procs if alive(p)]
