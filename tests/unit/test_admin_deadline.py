"""Every request of the CLI has a deadline over the whole request: a server that trickles its
answer a byte at a time (each byte inside the read timeout, which restarts on every byte) or
sends its headers and stalls is cut there; `status` and `--wait --timeout` end on time.

The servers are this process's own sockets on loopback (the owner check passes: same user),
as the daemon's port held by SGLang under the service user would be."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.admin import client as adminclient
from testkit.cli import kimi_serve

ME = frozenset({0})
# A trickled answer that would take minutes at its pace: only a deadline ends it sooner.
TRICKLE_S = 0.4
LONG_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"X-Pad: a\r\n" * 400


def _serve(handle: Callable[[socket.socket], None]) -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    port = int(server.getsockname()[1])

    def run() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_talk, args=(conn, handle, stop), daemon=True).start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join(5)
        server.close()


def _talk(
    conn: socket.socket, handle: Callable[[socket.socket], None], stop: threading.Event
) -> None:
    with conn:
        conn.settimeout(5)
        try:
            conn.recv(65536)  # the request
            handle(conn)
            stop.wait(120)  # hold the connection open: the client must give up by itself
        except OSError:
            return


def _trickle(conn: socket.socket) -> None:
    for byte in LONG_ANSWER:
        conn.sendall(bytes([byte]))
        time.sleep(TRICKLE_S)


def _headers_then_stall(conn: socket.socket) -> None:
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )


@pytest.fixture
def trickling() -> Iterator[int]:
    yield from _serve(_trickle)


@pytest.fixture
def stalling() -> Iterator[int]:
    yield from _serve(_headers_then_stall)


def test_a_trickled_answer_is_cut_at_the_deadline(trickling: int) -> None:
    began = time.monotonic()
    with pytest.raises(adminclient.Unreachable, match=r"no whole answer within 2 s"):
        adminclient.request(
            "GET",
            f"http://127.0.0.1:{trickling}",
            "/status",
            trusted=ME,
            read_timeout=1.0,
            deadline=2.0,
        )
    # Each byte came within the read timeout: without the deadline this ran for minutes.
    assert time.monotonic() - began < len(LONG_ANSWER) * TRICKLE_S / 4


def test_headers_then_a_stall_are_cut_at_the_deadline(stalling: int) -> None:
    began = time.monotonic()
    with pytest.raises(adminclient.Unreachable, match=r"no whole answer within 1 s"):
        adminclient.request(
            "GET",
            f"http://127.0.0.1:{stalling}",
            "/status",
            trusted=ME,
            read_timeout=60.0,
            deadline=1.0,
        )
    assert time.monotonic() - began < 30.0  # not the 60 s read timeout


def test_the_default_deadline_is_the_connect_and_read_timeouts_added(stalling: int) -> None:
    with pytest.raises(adminclient.Unreachable, match=r"within 1\.5 s|timed out"):
        adminclient.request(
            "GET",
            f"http://127.0.0.1:{stalling}",
            "/status",
            trusted=ME,
            timeout=0.5,
            read_timeout=1.0,
        )


def test_status_against_a_trickling_port_exits_4_at_its_deadline(trickling: int) -> None:
    began = time.monotonic()
    done = kimi_serve("status", "--url", f"http://127.0.0.1:{trickling}")
    took = time.monotonic() - began
    assert done.returncode == 4, done.stderr
    assert "no whole answer within 10 s" in done.stderr
    assert took < 25.0, took  # was: as long as the server kept trickling (over 40 s measured)


def test_a_wait_ends_within_a_second_of_its_timeout_whatever_the_endpoint_does(
    tmp_path: Path, trickling: int
) -> None:
    token = tmp_path / "admin.token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    began = time.monotonic()
    done = kimi_serve(
        "reexec",
        "--wait",
        "--timeout",
        "3s",
        "--url",
        f"http://127.0.0.1:{trickling}",
        "--token-file",
        str(token),
    )
    took = time.monotonic() - began
    assert done.returncode == 4, (done.returncode, done.stderr)
    assert "no whole answer within 3.5 s" in done.stderr, done.stderr
    # 3 s and the grace; the ceiling leaves the interpreter's start room on a loaded machine.
    assert took < 3.5 + 10.0, took
