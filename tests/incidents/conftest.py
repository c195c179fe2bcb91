"""Fixtures for the incident tests: hung Python processes and fake py-spy programs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.standin.conftest import Launcher

# A child stuck in a function whose name the tests look for in py-spy's dump. It prints its pid
# once it is inside that function, so a test waits on that line, never on a sleep.
HUNG_CHILD = textwrap.dedent(
    """
    import os, sys, threading, time

    def wedged_in_all_reduce():
        print(os.getpid(), flush=True)
        threading.Event().wait()

    wedged_in_all_reduce()
    """
)

Spawn = Callable[[], subprocess.Popen[str]]


@pytest.fixture
def hung_child() -> Iterator[Spawn]:
    started: list[subprocess.Popen[str]] = []

    def spawn() -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HUNG_CHILD], stdout=subprocess.PIPE, text=True
        )
        started.append(proc)
        assert proc.stdout is not None
        assert int(proc.stdout.readline()) == proc.pid  # inside the named function now
        return proc

    yield spawn
    for proc in started:
        proc.kill()
        proc.wait()


@pytest.fixture
def fake_py_spy(tmp_path: Path) -> Callable[[str], str]:
    """Write an executable stand-in for py-spy with the given shell body; returns its path."""

    def make(body: str) -> str:
        path = tmp_path / f"py-spy-{len(list(tmp_path.glob('py-spy-*')))}"
        path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
        path.chmod(0o755)
        return str(path)

    return make


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); its state says it is gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)


def kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launch() -> Iterator[Launcher]:
    launcher = Launcher()
    yield launcher
    launcher.cleanup()
