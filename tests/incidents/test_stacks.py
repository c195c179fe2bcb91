"""supervisor.incidents.stacks:
real py-spy against real hung processes; fake py-spy programs only where
py-spy itself must misbehave (hang, fail on --native) or must be shown running in parallel."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from supervisor.incidents import stacks
from supervisor.incidents.stacks import (
    FAILED,
    NO_PRIVILEGE,
    PROCESS_GONE,
    PY_SPY_MISSING,
    TIMED_OUT,
    capture,
    classify,
    find_py_spy,
    innermost,
    parse,
    render,
)
from testkit import wait_until
from testkit.incidents import Spawn, kill_quietly, pid_alive

# What py-spy 0.4 prints (seen here) when it is refused, and when the process is gone.
EPERM_OUTPUT = """Error: Failed to get process executable name. Check that the process is running.

Caused by:
    0: Permission denied (os error 13)
    1: Permission denied (os error 13)
"""
GONE_OUTPUT = """Error: Failed to get process executable name. Check that the process is running.

Caused by:
    0: No such file or directory (os error 2)
"""
PTRACE_EPERM_OUTPUT = "Error: Operation not permitted (os error 1)\n"


def test_py_spy_is_found_next_to_the_interpreter() -> None:
    # Installed as a dependency of kimi-serve, into the same environment's bin directory.
    assert find_py_spy() == str(Path(sys.executable).parent / "py-spy")


@pytest.mark.parametrize(
    ("code", "output", "alive", "verdict"),
    [
        (0, 'Thread 1 (idle): "MainThread"\n    f (x.py:1)\n', True, None),
        (1, EPERM_OUTPUT, True, NO_PRIVILEGE),
        (1, PTRACE_EPERM_OUTPUT, True, NO_PRIVILEGE),
        (1, GONE_OUTPUT, False, PROCESS_GONE),
        (1, GONE_OUTPUT, True, PROCESS_GONE),
        (1, EPERM_OUTPUT, False, PROCESS_GONE),
        (1, "Error: unsupported python version\n", True, FAILED),
        (0, "", True, FAILED),
    ],
)
def test_classify(code: int, output: str, alive: bool, verdict: str | None) -> None:
    assert classify(code, output, alive) == verdict


async def test_a_hung_process_shows_the_frame_it_hangs_in(hung_child: Spawn) -> None:
    proc = hung_child()
    cap = await capture([proc.pid], timeout=10.0)
    assert cap.ok, cap
    (one,) = cap.stacks
    assert one.ok and one.pid == proc.pid
    assert "wedged_in_all_reduce" in one.text
    # Rendered, parsed back, and shown innermost first: the hung frame is among the first lines.
    (dump,) = parse(render(cap))
    assert dump.pid == proc.pid and dump.error is None
    lines = innermost(dump)
    assert lines[0].startswith("Thread ")
    assert any("wedged_in_all_reduce" in line for line in lines[1:9]), lines
    assert pid_alive(proc.pid)  # a dump pauses the process; it never ends it


async def test_native_frames_where_py_spy_can(hung_child: Spawn) -> None:
    proc = hung_child()
    cap = await capture([proc.pid], timeout=10.0, native=True)
    (one,) = cap.stacks
    assert one.ok
    # py-spy unwinds CPython's own C frames on x86_64 Linux: the wait is seen inside libc.
    assert one.native, one.text
    assert "libc" in one.text or "libpthread" in one.text, one.text


async def test_a_failed_native_dump_is_retried_without(
    hung_child: Spawn, fake_py_spy: Callable[[str], str]
) -> None:
    real = find_py_spy()
    assert real
    fake = fake_py_spy(
        f"""
        for a in "$@"; do
          if [ "$a" = --native ]; then echo "Error: Failed to unwind native stack" >&2; exit 1; fi
        done
        exec {real} "$@"
        """
    )
    proc = hung_child()
    cap = await capture([proc.pid], timeout=10.0, py_spy=fake)
    (one,) = cap.stacks
    assert one.ok and not one.native
    assert "wedged_in_all_reduce" in one.text


async def test_every_process_is_dumped_in_parallel(
    tmp_path: Path, fake_py_spy: Callable[[str], str]
) -> None:
    # Each fake dump waits until all four have started: only a parallel capture finishes.
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    fake = fake_py_spy(
        f"""
        pid=$3
        touch {barrier}/$$
        while [ "$(ls {barrier} | wc -l)" -lt 4 ]; do sleep 0.01; done
        printf 'Thread %s (active): "MainThread"\\n    step_%s (x.py:1)\\n' $pid $pid
        """
    )
    pids = [os.getpid(), os.getppid(), 1, os.getpid()]
    cap = await capture(pids, timeout=10.0, py_spy=fake, native=False)
    assert [s.ok for s in cap.stacks] == [True] * 4, cap
    assert [s.pid for s in cap.stacks] == pids  # in the order asked
    assert f"step_{os.getppid()}" in cap.stacks[1].text


async def test_a_hanging_py_spy_is_killed_when_the_budget_is_spent(
    tmp_path: Path, hung_child: Spawn, fake_py_spy: Callable[[str], str]
) -> None:
    # A py-spy that hangs, and leaves a child holding its output open.
    pids = tmp_path / "pids"
    fake = fake_py_spy(
        f"""
        sleep 1000 &
        echo $$ $! >> {pids}
        echo "attaching..."
        wait
        """
    )
    proc = hung_child()
    budget = 1.0
    started = time.monotonic()
    cap = await capture([proc.pid, proc.pid], timeout=budget, py_spy=fake, native=False)
    spent = time.monotonic() - started
    assert [s.error for s in cap.stacks] == [TIMED_OUT, TIMED_OUT]
    assert cap.reason is not None and cap.reason.startswith(TIMED_OUT)
    assert "attaching..." in cap.stacks[0].text  # what it said before it was killed is kept
    # The budget holds: killing the py-spy's process group takes milliseconds, not seconds.
    assert spent < budget + 1.0, spent
    started_pids = [int(p) for line in pids.read_text().split("\n") if line for p in line.split()]
    assert len(started_pids) == 4
    wait_until(
        lambda: not any(pid_alive(p) for p in started_pids),
        2.0,
        "every fake py-spy and its child to be gone",
    )
    assert pid_alive(proc.pid)  # the capture never touches the target itself


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root, setpriv")
async def test_without_the_privilege_the_capture_says_why(
    hung_child: Spawn, fake_py_spy: Callable[[str], str]
) -> None:
    # The target runs as root with every capability; a py-spy with none may not trace it
    # (the tracer must hold every capability the tracee has, or CAP_SYS_PTRACE): the same
    # EPERM as under Yama's ptrace_scope=1 for a sibling.
    real = find_py_spy()
    fake = fake_py_spy(
        f'exec setpriv --bounding-set=-all --inh-caps=-all --ambient-caps=-all {real} "$@"\n'
    )
    proc = hung_child()
    cap = await capture([proc.pid], timeout=10.0, py_spy=fake)
    (one,) = cap.stacks
    assert one.error == NO_PRIVILEGE, one.text
    assert cap.reason is not None
    assert cap.reason.startswith(NO_PRIVILEGE) and "CAP_SYS_PTRACE" in cap.reason
    summary = cap.summary()
    assert summary["taken"] is False
    assert "Permission denied" in summary["processes"][0]["message"]  # type: ignore[index]


async def test_py_spy_missing(hung_child: Spawn, tmp_path: Path) -> None:
    cap = await capture([hung_child().pid], timeout=5.0, py_spy=str(tmp_path / "nope"))
    assert not cap.ok and cap.stacks == ()
    assert cap.reason is not None and cap.reason.startswith(PY_SPY_MISSING)


async def test_a_dead_process_is_not_dumped(hung_child: Spawn) -> None:
    proc = hung_child()
    proc.kill()
    proc.wait()
    cap = await capture([proc.pid], timeout=5.0)
    assert [s.error for s in cap.stacks] == [PROCESS_GONE]
    assert cap.reason is not None and cap.reason.startswith(PROCESS_GONE)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root, setpriv")
def test_py_spy_alone_gets_the_capability() -> None:
    # A daemon started with CAP_SYS_PTRACE ambient (as the unit does): after confine(), a
    # program it starts (SGLang) has no ambient capability, py-spy started through _spawn has it.
    script = (
        "import subprocess, sys, tempfile\n"
        "from supervisor.incidents import stacks\n"
        "stacks.confine()\n"
        "probe = ['grep', 'CapAmb', '/proc/self/status']\n"
        "plain = subprocess.run(probe, capture_output=True, text=True).stdout.split()[1]\n"
        "with tempfile.TemporaryFile() as out:\n"
        "    stacks._spawn(probe, out.fileno()).wait()\n"
        "    out.seek(0)\n"
        "    spied = out.read().decode().split()[1]\n"
        "plain2 = subprocess.run(probe, capture_output=True, text=True).stdout.split()[1]\n"
        "print(plain, spied, plain2)\n"
    )
    done = subprocess.run(
        [
            "setpriv",
            "--inh-caps=+sys_ptrace",
            "--ambient-caps=+sys_ptrace",
            sys.executable,
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    plain, spied, plain2 = (int(x, 16) for x in done.stdout.split())
    bit = 1 << stacks.CAP_SYS_PTRACE
    assert plain == 0 and plain2 == 0, done.stdout
    assert spied == bit, done.stdout


async def test_the_standin_decode_hang_shows_its_hung_frame(launch) -> None:  # type: ignore[no-untyped-def]
    import httpx

    s = launch(env={"STANDIN_FAULT": "decode-hang", "STANDIN_HANG_AFTER_DECODES": "0"})
    with pytest.raises(httpx.ReadTimeout):
        await asyncio.to_thread(s.generate, timeout=0.5)
    s.wait_line("Prefill batch")  # the request reached the hung step
    pids = [s.proc.pid, *(c.pid for c in s.children())]
    # The log line comes just before the step: dump until the thread is inside it.
    deadline = time.monotonic() + 10.0
    while True:
        cap = await capture(pids, timeout=10.0)
        assert all(st.ok for st in cap.stacks), render(cap)
        if "decode_step_hung" in cap.stacks[0].text or time.monotonic() > deadline:
            break
    assert "decode_step_hung" in cap.stacks[0].text, render(cap)
    assert len(cap.stacks) == len(pids) >= 2  # the main process and its scheduler children
    for pid in pids:
        kill_quietly(pid)


async def test_a_native_dump_that_hangs_leaves_time_for_a_python_one(
    hung_child: Spawn, fake_py_spy: Callable[[str], str]
) -> None:
    real = find_py_spy()
    fake = fake_py_spy(
        f"""
        for a in "$@"; do [ "$a" = --native ] && exec sleep 1000; done
        exec {real} "$@"
        """
    )
    proc = hung_child()
    started = time.monotonic()
    cap = await capture([proc.pid], timeout=2.0, py_spy=fake)
    (one,) = cap.stacks
    assert one.ok and not one.native, one
    assert "wedged_in_all_reduce" in one.text
    assert time.monotonic() - started < 2.0 + 1.0


async def test_a_stopped_process_is_read_without_pausing_it(hung_child: Spawn) -> None:
    # SIGSTOP is how a test (or an operator) freezes a server; py-spy's pause fails on it.
    proc = hung_child()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        # The signal is delivered asynchronously: capture only once the kernel shows it stopped.
        wait_until(
            lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 10, "stopped"
        )
        cap = await capture([proc.pid], timeout=10.0)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert cap.ok, render(cap)
    assert "wedged_in_all_reduce" in cap.stacks[0].text and not cap.stacks[0].native
