"""Fixtures for the incident tests: hung Python processes and fake py-spy programs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from testkit.incidents import Spawn
from testkit.standin import Launcher

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


@pytest.fixture
def launch() -> Iterator[Launcher]:
    with Launcher() as launcher:
        yield launcher
