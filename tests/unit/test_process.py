"""supervisor.process and supervisor.process.signals in process: real children, real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from supervisor.process import LAUNCH_ENV, Child, ProcessOwner, signals
from supervisor.process import pipes as process
from supervisor.process.identity import OWNER_ENV, ProcessIdentity, identity_of
from supervisor.sglang.logscan import Stream

# Prints its environment's markers, then lines on both streams; drains on SIGTERM unless told
# to ignore it.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    print("owner", os.environ.get("KIMI_SERVE_OWNER"), flush=True)
    print("notify", os.environ.get("NOTIFY_SOCKET"), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    print("up", flush=True)
    while True:
        time.sleep(0.05)
    """
)


class Seen:
    def __init__(self) -> None:
        self.lines: list[tuple[int, Stream, str]] = []
        self.exits: list[Child] = []
        self.changed = asyncio.Event()

    def sink(self, launch: int, stream: Stream, lines: list[str]) -> None:
        self.lines += [(launch, stream, line) for line in lines]
        self.changed.set()

    def exited(self, child: Child) -> None:
        self.exits.append(child)
        self.changed.set()

    async def until(self, cond: object, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not cond():  # type: ignore[operator]
                self.changed.clear()
                await self.changed.wait()

    def text(self, stream: Stream = Stream.STDOUT) -> list[str]:
        return [line for _, s, line in self.lines if s is stream]


@pytest.fixture
def owner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ProcessOwner, Seen]:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    seen = Seen()
    return ProcessOwner(str(tmp_path), seen.sink, seen.exited), seen


def spawn(owner: ProcessOwner, **env: str) -> Child:
    return owner.spawn(1, [sys.executable, "-c", CHILD], env, None)


async def test_lines_and_exit_arrive_and_the_child_carries_our_marker(
    owner: tuple[ProcessOwner, Seen], tmp_path: Path
) -> None:
    po, seen = owner
    child = spawn(po)
    # stdout and stderr are separate pipes: wait for both lines, in whichever order they come.
    await seen.until(lambda: "up" in seen.text() and bool(seen.text(Stream.STDERR)))
    assert f"owner {tmp_path}" in seen.text()
    assert "notify None" in seen.text()  # our notify socket is not SGLang's
    assert seen.text(Stream.STDERR) == ["to stderr"]
    assert psutil.Process(child.pid).environ()[LAUNCH_ENV] == f"{os.getpid()}-1"
    assert [p.pid for p in po.marked_processes()] == [child.pid]
    info = await po.stop(child, graceful=True, drain_timeout=5)
    assert (info.exit_code, info.signal, info.stuck) == (7, None, ())
    assert seen.exits == [child] and child.stop_done


async def test_a_child_that_ignores_sigterm_is_killed_after_the_drain(
    owner: tuple[ProcessOwner, Seen],
) -> None:
    po, seen = owner
    child = spawn(po, IGNORE_TERM="1")
    await seen.until(lambda: "up" in seen.text())
    info = await po.stop(child, graceful=True, drain_timeout=0.3)
    assert info.signal == signal.SIGKILL


async def test_hurry_cuts_a_long_drain_short(owner: tuple[ProcessOwner, Seen]) -> None:
    po, seen = owner
    child = spawn(po, IGNORE_TERM="1")
    await seen.until(lambda: "up" in seen.text())
    stop = asyncio.ensure_future(po.stop(child, graceful=True, drain_timeout=600))
    await asyncio.sleep(0)  # the stop is draining
    assert child.stop_begun and not stop.done()
    po.hurry(child)
    info = await asyncio.wait_for(stop, 10)
    assert info.signal == signal.SIGKILL


async def test_terminate_signals_only_the_very_process_named() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = identity_of(proc.pid)
        assert ident is not None
        reused = ProcessIdentity(proc.pid, ident.create_time - 100)  # the pid, another process
        done = await signals.terminate([reused], grace=0.1, kill_wait=0.1)
        assert done.notes == {proc.pid: "not signalled: the pid now names another process"}
        assert proc.poll() is None
        done = await signals.terminate([ident], grace=2.0, kill_wait=5.0)
        proc.wait(5)
        assert done.notes == {proc.pid: "SIGTERM"} and done.alive == []
    finally:
        proc.kill()
        proc.wait()


async def test_terminate_escalates_to_sigkill_after_the_grace() -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print(1, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline()  # the handler is in place
        ident = identity_of(proc.pid)
        assert ident is not None
        done = await signals.terminate([ident], grace=0.2, kill_wait=5.0)
        assert proc.wait(5) == -signal.SIGKILL
        assert done.notes == {proc.pid: "SIGTERM, SIGKILL"} and done.alive == []
        again = await signals.terminate([ident], kill_wait=0.1)
        assert again.notes[proc.pid].startswith("already gone")
    finally:
        proc.kill()
        proc.wait()


def test_owner_env_name_is_the_contract() -> None:
    assert OWNER_ENV == "KIMI_SERVE_OWNER"


class _PipeChild:
    """What a pump needs of its child: the launch, and the count of pipes still open."""

    launch = 1

    def __init__(self) -> None:
        self._open_pipes = 1
        self.pipes_closed = asyncio.Event()


async def test_after_a_short_read_the_pump_waits_and_then_reads_what_came_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process, "_READ_PAUSE_S", 0.5)  # wide, so a busy machine still fits
    batches: list[list[str]] = []
    arrived = asyncio.Event()

    def sink(_launch: int, _stream: Stream, lines: list[str]) -> None:
        batches.append(lines)
        arrived.set()

    r, w = os.pipe()
    os.set_blocking(r, False)
    child = _PipeChild()
    process._Pump(child, Stream.STDOUT, r, sink)  # type: ignore[arg-type]
    os.write(w, b"first\n")
    await asyncio.wait_for(arrived.wait(), 10)
    for line in (b"b\n", b"c\n", b"d\n"):  # each a write of its own, the loop run between
        os.write(w, line)
        for _ in range(3):
            await asyncio.sleep(0)
    assert batches == [["first"]]  # paused: nothing read meanwhile
    arrived.clear()
    await asyncio.wait_for(arrived.wait(), 10)
    assert batches == [["first"], ["b", "c", "d"]]  # then all of it in one read
    os.close(w)
    await asyncio.wait_for(child.pipes_closed.wait(), 10)  # the end is still seen
