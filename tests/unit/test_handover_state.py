"""daemon.handover's state descriptor: trusted only when it is a hand-over memfd written for
this process; anything else is ignored (the start is then an ordinary one) and the variable
never reaches SGLang's environment."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
from collections.abc import Iterator

import pytest

from supervisor.daemon.adoption import take
from supervisor.daemon.handover import (
    DIGEST_ENV,
    ENV,
    FORMAT,
    MEMFD_NAME,
    SEALS,
    _memfd,
    stuck_threads,
)


@pytest.fixture(autouse=True)
def no_variable() -> Iterator[None]:
    yield
    os.environ.pop(ENV, None)
    os.environ.pop(DIGEST_ENV, None)


def memfd(doc: object, name: str = MEMFD_NAME) -> int:
    """A state as the old daemon passes it: sealed, its digest in DIGEST_ENV."""
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)
    data = json.dumps(doc).encode()
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    os.environ[DIGEST_ENV] = hashlib.sha256(data).hexdigest()
    return fd


def test_the_state_is_sealed_against_any_writer_even_through_proc() -> None:
    fd, digest = _memfd({"format": FORMAT, "pid": os.getpid()})
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    with pytest.raises(PermissionError):
        os.write(fd, b"x")
    # Another process of the user opens it anew through /proc/<pid>/fd: still no writing,
    # no truncating, no removing the seals.
    again = os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.write(again, b"{}")
        with pytest.raises(PermissionError):
            os.ftruncate(again, 0)
        with pytest.raises(PermissionError):
            fcntl.fcntl(again, fcntl.F_ADD_SEALS, 0)
    finally:
        os.close(again)
    assert hashlib.sha256(os.pread(fd, 1 << 16, 0)).hexdigest() == digest
    os.close(fd)


def test_an_unsealed_state_is_ignored() -> None:
    fd = os.memfd_create(MEMFD_NAME, 0)
    data = json.dumps({"format": FORMAT, "pid": os.getpid()}).encode()
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    os.environ[ENV] = str(fd)
    os.environ[DIGEST_ENV] = hashlib.sha256(data).hexdigest()
    assert take() is None


def test_a_state_whose_digest_differs_is_ignored() -> None:
    fd = memfd({"format": FORMAT, "pid": os.getpid()})
    os.environ[ENV] = str(fd)
    os.environ[DIGEST_ENV] = "0" * 64
    assert take() is None
    assert DIGEST_ENV not in os.environ  # never inherited by SGLang either


def test_no_variable_is_an_ordinary_start() -> None:
    assert take() is None


def test_a_state_for_this_process_is_taken_with_its_listening_socket() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    fd = memfd({"format": FORMAT, "pid": os.getpid(), "admin_fd": listener.fileno()})
    os.environ[ENV] = str(fd)
    got = take()
    assert got is not None and got.doc["pid"] == os.getpid()
    assert got.admin is not None and got.admin.fileno() == listener.fileno()
    assert ENV not in os.environ  # never inherited by SGLang
    with pytest.raises(OSError):
        os.fstat(fd)  # read and closed
    listener.detach()
    got.admin.close()


@pytest.mark.parametrize(
    "doc",
    [
        {"format": FORMAT, "pid": 1},  # written for another process
        {"format": FORMAT + 1},  # another format
        ["not", "a", "state"],
    ],
)
def test_a_state_not_written_for_this_process_is_ignored(doc: object) -> None:
    os.environ[ENV] = str(memfd(doc))
    assert take() is None
    assert ENV not in os.environ


def test_a_descriptor_that_is_no_hand_over_memfd_is_ignored() -> None:
    r, w = os.pipe()
    os.environ[ENV] = str(r)
    assert take() is None
    os.close(r)
    os.close(w)
    os.environ[ENV] = str(memfd({"format": FORMAT, "pid": os.getpid()}, name="other"))
    assert take() is None


def test_a_stale_number_is_ignored() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    os.environ[ENV] = str(r)
    assert take() is None
    os.environ[ENV] = "garbage"
    assert take() is None


def test_an_unreadable_state_is_ignored() -> None:
    fd = os.memfd_create(MEMFD_NAME, os.MFD_ALLOW_SEALING)
    os.write(fd, b"{half a state")
    os.lseek(fd, 0, os.SEEK_SET)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    os.environ[DIGEST_ENV] = hashlib.sha256(b"{half a state").hexdigest()
    os.environ[ENV] = str(fd)
    assert take() is None


def test_an_admin_descriptor_that_is_not_listening_is_not_served_on() -> None:
    a, b = socket.socketpair()
    fd = memfd({"format": FORMAT, "pid": os.getpid(), "admin_fd": a.fileno()})
    os.environ[ENV] = str(fd)
    got = take()
    assert got is not None and got.admin is None
    with pytest.raises(OSError):
        os.fstat(a.detach())  # closed, not leaked
    b.close()


def test_threads_in_d_state_are_found(tmp_path: object) -> None:
    import pathlib

    root = pathlib.Path(str(tmp_path))
    for tid, state in (("10", "S"), ("11", "D"), ("12", "R")):
        (root / tid).mkdir()
        (root / tid / "stat").write_text(f"{tid} (python3 (x) y) {state} 1 2 3\n")
    assert stuck_threads(str(root)) == [11]
    assert stuck_threads() == []  # this process: none
