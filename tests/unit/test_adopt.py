"""process.adopt with real processes and real pipes: what a hand-over verifies before it adopts
SGLang, each failure a reason to fall back (a pipe closed, a process that ended during the
exec, another process under the pid, another boot), and reaping without a Popen."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from supervisor.process.adopt import Adopted, Pipe, Unverifiable, pipe_inode, verify
from supervisor.process.identity import ProcessIdentity, current_boot_id, identity_of

BOOT = current_boot_id()
Running = tuple[subprocess.Popen[bytes], ProcessIdentity, dict[str, Pipe]]


@pytest.fixture
def sglang() -> Iterator[Running]:
    """A child with its stdout on a pipe whose read end we hold, as the daemon holds SGLang's."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    ident = identity_of(proc.pid)
    assert ident is not None
    yield proc, ident, {"stdout": Pipe(fd, pipe_inode(fd), b"")}
    proc.kill()
    proc.wait()


def test_a_live_child_with_its_pipe_verifies(sglang: Running) -> None:
    _, ident, pipes = sglang
    verify(ident, BOOT, [], pipes)


def test_a_pipe_already_closed_is_unverifiable(sglang: Running) -> None:
    proc, ident, pipes = sglang
    assert proc.stdout is not None
    proc.stdout.close()
    with pytest.raises(Unverifiable, match=r"stdout pipe .* is closed"):
        verify(ident, BOOT, [], pipes)


def test_another_pipe_under_the_number_is_unverifiable(sglang: Running) -> None:
    _, ident, pipes = sglang
    r, w = os.pipe()
    try:
        wrong = {"stdout": Pipe(r, pipes["stdout"].inode, b"")}
        with pytest.raises(Unverifiable, match="is not SGLang's stdout pipe"):
            verify(ident, BOOT, [], wrong)
    finally:
        os.close(r)
        os.close(w)


def test_a_child_that_died_during_the_exec_is_unverifiable_and_reaped(sglang: Running) -> None:
    proc, ident, pipes = sglang
    proc.kill()
    # A zombie now (nobody waited): the new daemon finds it so.
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    with pytest.raises(Unverifiable, match="ended during the exec"):
        verify(ident, BOOT, [], pipes)
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)  # verify reaped it: no zombie stays
    proc.returncode = -9  # for the fixture's wait


def test_another_process_under_the_pid_is_unverifiable(sglang: Running) -> None:
    _, ident, pipes = sglang
    older = ProcessIdentity(ident.pid, ident.create_time - 100.0)
    with pytest.raises(Unverifiable, match="not the SGLang process"):
        verify(older, BOOT, [], pipes)


def test_a_worker_that_ended_is_unverifiable(sglang: Running) -> None:
    _, ident, pipes = sglang
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_ident = identity_of(gone.pid)
    assert gone_ident is not None
    gone.wait()
    with pytest.raises(Unverifiable, match=f"process {gone.pid} ended"):
        verify(ident, BOOT, [gone_ident], pipes)


def test_a_state_of_another_boot_is_unverifiable(sglang: Running) -> None:
    _, ident, pipes = sglang
    with pytest.raises(Unverifiable, match="another boot"):
        verify(ident, "00000000-0000-0000-0000-000000000000", [], pipes)


def test_a_process_not_our_child_is_unverifiable(sglang: Running) -> None:
    _, _, pipes = sglang
    parent = identity_of(os.getppid())
    assert parent is not None
    with pytest.raises(Unverifiable, match="not our child"):
        verify(parent, BOOT, [], pipes)


def test_adopted_reaps_through_waitpid_with_popens_return_codes() -> None:
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    a, b = Adopted(killed.pid), Adopted(exited.pid)
    assert a.poll() is None
    killed.kill()
    assert a.wait() == -9 and a.poll() == -9 and a.returncode == -9
    assert b.wait() == 3
    killed.returncode = exited.returncode = 0  # reaped through Adopted, not these Popens
