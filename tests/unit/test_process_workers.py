"""The process owner against real processes: a main process that starts its workers the way
SGLang does (multiprocessing "spawn", PR_SET_PDEATHSIG, a resource tracker), in a session of
its own. Any worker's death is reported at once; a worker's exit status is read while it is a
zombie; a process whose environment lost the owner marker is still found by its session.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from supervisor.process import Child, ProcessOwner, exit_status_of_zombie, worker_title
from supervisor.process.identity import (
    OWNER_ENV,
    ProcessIdentity,
    identity_of,
    launch_leader,
    live_process,
    session_members,
)
from supervisor.sglang.logscan import Stream
from testkit.wait import wait_until_async

SERVER = textwrap.dedent(
    """
    import ctypes, multiprocessing as mp, os, signal, subprocess, sys, time

    def work(helper):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, as SGLang's workers
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        print("handler", flush=True)
        if helper:
            # A helper of the worker's own whose command line looks like a spawn child's (a
            # daemonic worker may not use multiprocessing itself): it does its work and ends
            # with 0 while the worker waits for it.
            code = "import time; time.sleep(1.0)  # multiprocessing.spawn"
            h = subprocess.Popen([sys.executable, "-c", code])
            print("helper", h.pid, flush=True)
            print("helper-done", h.wait(), flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        p = mp.get_context("spawn").Process(target=work, args=("helper" in sys.argv,), daemon=True)
        p.start()
        if "escapee" in sys.argv:
            # A member whose environment carries no marker (as after setproctitle).
            subprocess.Popen(["env", "-i", "sleep", "600"])
        def term(*_):
            p.terminate()
            p.join()
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        print("worker", p.pid, flush=True)
        # A short-lived helper (a compiler, nvidia-smi): its exit is not a death of the launch.
        subprocess.run(["sleep", "0.5"])
        time.sleep(600)
    """
)

DEADLINE = 10.0


class Owner:
    def __init__(self, tmp_path: Path) -> None:
        self.script = tmp_path / "server.py"
        self.script.write_text(SERVER)
        self.ended: list[Child] = []
        self.event = asyncio.Event()
        self.lines: list[str] = []
        self.owner = ProcessOwner(str(tmp_path / "state"), self._lines, self._exited)

    def _lines(self, _launch: int, _stream: Stream, lines: list[str]) -> None:
        self.lines += lines

    def _exited(self, child: Child) -> None:
        self.ended.append(child)
        self.event.set()

    async def start(self, *extra: str) -> Child:
        child = self.owner.spawn(1, [sys.executable, str(self.script), *extra], {}, None)
        await wait_until_async(
            lambda: {"worker", "handler"} <= {ln.split()[0] for ln in self.lines if ln}, DEADLINE
        )
        await wait_until_async(lambda: self._refresh(child, "worker"), DEADLINE)
        return child

    def _refresh(self, child: Child, what: str) -> bool:
        self.owner.refresh_tree(child)
        return any(what in t or "spawn" in t for t in child.watched.values())

    async def ended_within(self, seconds: float) -> Child:
        async with asyncio.timeout(seconds):
            await self.event.wait()
        return self.ended[0]


def worker_of(child: Child) -> ProcessIdentity:
    return next(i for i, t in child.watched.items() if "spawn" in t)


async def test_a_worker_killed_ends_the_launch_at_once(tmp_path: Path) -> None:
    o = Owner(tmp_path)
    child = await o.start()
    titles = sorted(child.watched.values())
    # The spawn child and multiprocessing's resource tracker are watched; `sleep` is not.
    assert titles == ["multiprocessing.resource_tracker", "multiprocessing.spawn child"]
    worker = worker_of(child)
    killed_at = time.monotonic()
    os.kill(worker.pid, signal.SIGKILL)
    ended = await o.ended_within(DEADLINE)
    noticed = time.monotonic() - killed_at
    assert ended is child and child.exit is not None
    assert child.exit.signal == signal.SIGKILL and child.exit.exit_code is None
    assert child.exit.process == f"multiprocessing.spawn child (pid {worker.pid})"
    assert child.main_alive()  # the main process did not notice; we did
    assert noticed < 1.0
    info = await o.owner.stop(child, graceful=False, drain_timeout=0)
    assert (info.signal, info.process, info.stuck) == (9, child.exit.process, ())
    assert not o.owner.survivors(child)
    assert len(o.ended) == 1  # one report per launch


async def test_a_worker_that_exits_reports_its_exit_code(tmp_path: Path) -> None:
    o = Owner(tmp_path)
    child = await o.start()
    worker = worker_of(child)
    os.kill(worker.pid, signal.SIGTERM)  # its handler exits 0: an exit, not a signal
    ended = await o.ended_within(DEADLINE)
    assert ended.exit is not None
    assert (ended.exit.exit_code, ended.exit.signal) == (0, None)
    await o.owner.stop(child, graceful=False, drain_timeout=0)
    assert not o.owner.survivors(child)


async def test_a_workers_own_helper_ending_with_0_is_not_a_death(tmp_path: Path) -> None:
    o = Owner(tmp_path)
    child = await o.start("helper")
    await wait_until_async(lambda: any(ln.startswith("helper ") for ln in o.lines), DEADLINE)
    helper = int(next(ln for ln in o.lines if ln.startswith("helper ")).split()[1])
    # Seen (and watched, its command line is a spawn child's) while it runs.
    await wait_until_async(
        lambda: o._refresh(child, "spawn") and helper in {i.pid for i in child.watched}, DEADLINE
    )
    await wait_until_async(lambda: "helper-done 0" in o.lines, DEADLINE)
    worker = worker_of(child)
    # Its end was judged: the pidfd callback ran (the watch of a dead pid is closed).
    await wait_until_async(
        lambda: not psutil.pid_exists(helper) or live_process(_ident(child, helper)) is None,
        DEADLINE,
    )
    for _ in range(5):
        await asyncio.sleep(0)  # let the loop run the pidfd callback it has pending
    assert child.exit is None and not child.dying and o.ended == []
    # The worker itself still ends the launch when it dies.
    os.kill(worker.pid, signal.SIGKILL)
    ended = await o.ended_within(DEADLINE)
    assert ended.exit is not None and ended.exit.process.endswith(f"(pid {worker.pid})")
    await o.owner.stop(child, graceful=False, drain_timeout=0)


def _ident(child: Child, pid: int) -> ProcessIdentity:
    return next(i for i in child.watched if i.pid == pid)


async def test_the_resource_tracker_is_part_of_the_launch(tmp_path: Path) -> None:
    o = Owner(tmp_path)
    child = await o.start()
    tracker = next(i for i, t in child.watched.items() if "resource_tracker" in t)
    os.kill(tracker.pid, signal.SIGKILL)
    ended = await o.ended_within(DEADLINE)
    assert ended.exit is not None
    assert ended.exit.process == f"multiprocessing.resource_tracker (pid {tracker.pid})"
    await o.owner.stop(child, graceful=False, drain_timeout=0)
    assert not o.owner.survivors(child)


async def test_the_main_process_killed_is_reported_as_the_main(tmp_path: Path) -> None:
    # Its workers die too (PR_SET_PDEATHSIG): the report is the main's death, not theirs.
    o = Owner(tmp_path)
    child = await o.start()
    os.kill(child.pid, signal.SIGKILL)
    ended = await o.ended_within(DEADLINE)
    assert ended.exit is not None
    assert (ended.exit.signal, ended.exit.process) == (signal.SIGKILL, "")
    info = await o.owner.stop(child, graceful=False, drain_timeout=0)
    assert (info.signal, info.process) == (9, "")
    assert not o.owner.survivors(child)


async def test_workers_ending_during_a_graceful_stop_are_not_a_death(tmp_path: Path) -> None:
    o = Owner(tmp_path)
    child = await o.start()
    info = await o.owner.stop(child, graceful=True, drain_timeout=DEADLINE)
    assert (info.exit_code, info.signal, info.process) == (0, None, "")
    assert [c.exit for c in o.ended] == [child.main_exit]


async def test_a_transient_helper_is_not_watched(tmp_path: Path) -> None:
    o = Owner(tmp_path)
    child = await o.start()

    def helper_gone() -> bool:  # the helper `sleep 0.5` was recorded and has exited
        o.owner.refresh_tree(child)
        return any(live_process(i) is None for i in child.known)

    await wait_until_async(helper_gone, DEADLINE)
    assert not o.ended and child.alive()
    await o.owner.stop(child, graceful=False, drain_timeout=0)


async def test_the_session_finds_a_member_without_the_marker(tmp_path: Path) -> None:
    o = Owner(tmp_path)
    child = await o.start("escapee")

    def escapee() -> ProcessIdentity | None:
        for i in session_members(child.identity):
            p = live_process(i)
            if p is not None and p.cmdline()[:1] == ["sleep"] and OWNER_ENV not in p.environ():
                return i
        return None

    await wait_until_async(lambda: escapee() is not None, DEADLINE)
    found = escapee()
    assert found is not None
    assert found not in set(o.owner.marked_processes())  # the marker alone misses it
    # An earlier launch's record (main + worker): its session still names the escapee.
    recorded = {child.identity, worker_of(child)}
    assert launch_leader(recorded) == child.identity
    assert found in o.owner.leftovers(recorded)
    await o.owner.stop(child, graceful=False, drain_timeout=0)
    assert live_process(found) is None


def test_session_members_of_a_reused_pid_is_empty() -> None:
    # The leader's pid names another process now (different create time): nothing is ours.
    me = identity_of(os.getpid())
    assert me is not None
    assert session_members(ProcessIdentity(me.pid, me.create_time - 1000)) == []


def test_exit_status_of_a_real_zombie() -> None:
    for argv, want in (
        (["sh", "-c", "exit 3"], (3, None)),
        (["sh", "-c", "kill -9 $$"], (None, 9)),
    ):
        p = subprocess.Popen(argv)
        # Not reaped yet: the kernel keeps its status in /proc until we wait.
        deadline = time.monotonic() + DEADLINE
        while psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert exit_status_of_zombie(p.pid) == want
        p.wait()
        assert exit_status_of_zombie(p.pid) == (None, None)  # reaped: unknown


def test_exit_status_of_a_live_process_is_unknown() -> None:
    assert exit_status_of_zombie(os.getpid()) == (None, None)


@pytest.mark.parametrize(
    ("stat", "want"),
    [
        ("Z " + "0 " * 48 + "9", (None, 9)),
        ("Z " + "0 " * 48 + str(1 << 8), (1, None)),
        ("S " + "0 " * 48 + "9", (None, None)),  # not a zombie: field 52 means nothing yet
        ("Z 0 0", (None, None)),  # an old kernel without the field
    ],
)
def test_exit_status_parsing(
    tmp_path: Path, stat: str, want: tuple[int | None, int | None]
) -> None:
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "stat").write_text(f"77 (sglang::sched (x)) {stat}\n")
    assert exit_status_of_zombie(77, proc_root=str(tmp_path)) == want


@pytest.mark.parametrize(
    ("cmdline", "title"),
    [
        (["sglang::scheduler"] + [""] * 5, "sglang::scheduler"),
        (["sglang::scheduler_TP3"], "sglang::scheduler_TP3"),
        (["sglang::detokenizer"], "sglang::detokenizer"),
        (
            ["/v/bin/python", "-c", "from multiprocessing.resource_tracker import main;main(6)"],
            "multiprocessing.resource_tracker",
        ),
        (
            ["/v/bin/python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"],
            "multiprocessing.spawn child",
        ),
        (["gcc", "-O3", "x.c"], None),
        (["nvidia-smi", "--query-gpu=memory.total"], None),
        ([], None),
    ],
)
def test_worker_title(cmdline: list[str], title: str | None) -> None:
    assert worker_title(cmdline) == title
