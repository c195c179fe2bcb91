"""daemon.handover's state descriptor: trusted only when it is a hand-over memfd written for
this process; anything else is ignored (the start is then an ordinary one) and the variable
never reaches SGLang's environment."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import pytest

from supervisor.daemon.adoption import take
from supervisor.daemon.handover import ENV, FORMAT, MEMFD_NAME, stuck_threads


@pytest.fixture(autouse=True)
def no_variable() -> Iterator[None]:
    yield
    os.environ.pop(ENV, None)


def memfd(doc: object, name: str = MEMFD_NAME) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, json.dumps(doc).encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


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
    fd = os.memfd_create(MEMFD_NAME, 0)
    os.write(fd, b"{half a state")
    os.lseek(fd, 0, os.SEEK_SET)
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
