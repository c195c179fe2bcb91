"""The CLI's requests to the admin endpoint, sent only to the service itself.

On a loopback address the connection is made first, then the kernel is asked who owns its
other end (sockowner.peer_owner); the request, and the bearer token with it, is sent only if
that is root or the service user (`trusted`). Anyone else - a local user who bound the port
while the daemon was down - gets nothing, and nothing it answers is taken for the service's
state: NotTheService. On another address (`admin.allow_remote`) no such check is possible:
there an https:// URL, through the TLS proxy docs/security.md asks for, is what proves the
server is the service.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from supervisor import untrusted
from supervisor.admin import sockowner

MAX_ANSWER_BYTES = 16 << 20  # /status is a few KiB; /metrics some hundreds


class Unreachable(Exception):
    """No answer: refused, timed out, reset, or not HTTP."""


class NotTheService(Exception):
    """The admin address is held by a socket of a user that is neither root nor the service."""

    def __init__(self, address: str, uid: int | None, trusted: frozenset[int]) -> None:
        who = "nobody the kernel lists" if uid is None else sockowner.user_name(uid)
        them = ", ".join(sockowner.user_name(u) for u in sorted(trusted))
        super().__init__(
            f"the admin address {address} is held by {who}, not by root or the service user "
            f"({them}): another program holds the port (is the daemon down? `ss -ltnpe "
            f"'sport = :{address.rsplit(':', 1)[-1]}'` shows which); not sending the admin "
            "token, not trusting its answer"
        )
        self.uid = uid


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    body: bytes

    def json(self) -> Any:
        return untrusted.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class _Checked(http.client.HTTPConnection):
    """An HTTP connection that, once connected, checks who owns the server's socket."""

    def __init__(self, host: str, port: int | None, timeout: float, trusted: frozenset[int]):
        super().__init__(host, port, timeout=timeout)
        self.trusted = trusted

    def connect(self) -> None:
        super().connect()
        uid = sockowner.peer_owner(self.sock)
        if uid not in self.trusted:
            self.sock.close()
            raise NotTheService(f"{self.host}:{self.port}", uid, self.trusted)


def request(
    method: str,
    base: str,
    path: str,
    *,
    trusted: frozenset[int],
    token: str | None = None,
    timeout: float = 5.0,
    read_timeout: float | None = None,
    deadline: float | None = None,
) -> Answer:
    """One request; NotTheService (loopback, another user's socket) before anything is sent,
    Unreachable for no answer. `timeout` bounds the connection, `read_timeout` (default
    `timeout`) each read after it, and `deadline` (default the two added) the whole request:
    connect, headers and body. A server that trickles a byte at a time, each within the read
    timeout, is cut at the deadline (a socket timeout restarts on every byte)."""
    limit = (
        deadline
        if deadline is not None
        else timeout + (timeout if read_timeout is None else read_timeout)
    )
    ends = time.monotonic() + limit
    url = urllib.parse.urlsplit(base.rstrip("/") + path)
    host = url.hostname or ""
    try:
        port = url.port
    except ValueError as exc:
        raise Unreachable(f"bad URL {base!r}: {exc}") from None
    conn: http.client.HTTPConnection
    if url.scheme == "https":
        conn = http.client.HTTPSConnection(
            host, port, timeout=timeout, context=ssl.create_default_context()
        )
    elif url.scheme == "http" and sockowner.is_loopback_host(host):
        conn = _Checked(host, port, timeout, trusted)
    elif url.scheme == "http":
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    else:
        raise Unreachable(f"bad URL {base!r}: http:// or https:// expected")
    headers = {"Accept-Encoding": "identity", "Connection": "close"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    target = url.path + (f"?{url.query}" if url.query else "")
    conn.timeout = max(0.001, min(timeout, limit))
    cut = _Cutter(conn)
    watchdog = threading.Timer(limit, cut.fire)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()
        if conn.sock is not None:
            left = max(0.001, ends - time.monotonic())
            per_read = timeout if read_timeout is None else read_timeout
            conn.sock.settimeout(min(per_read, left))
        conn.request(method, target, headers=headers)
        r = conn.getresponse()
        body = r.read(MAX_ANSWER_BYTES + 1)
        if cut.fired:
            raise TimeoutError
        if len(body) > MAX_ANSWER_BYTES:
            raise Unreachable(f"an answer over {MAX_ANSWER_BYTES} bytes")
        return Answer(r.status, r.reason, body)
    except (TimeoutError, OSError, http.client.HTTPException, ValueError) as exc:
        if cut.fired or time.monotonic() >= ends:
            raise Unreachable(f"no whole answer within {limit:g} s") from None
        # ValueError: http.client's InvalidURL (a --url with a space, a control character).
        raise Unreachable(str(exc) or type(exc).__name__) from None
    finally:
        watchdog.cancel()
        conn.close()


class _Cutter:
    """Ends a request at its deadline: shuts its socket down, which wakes the read blocked on
    it (close alone would not, and may hand the descriptor to another thread's socket)."""

    def __init__(self, conn: http.client.HTTPConnection) -> None:
        self.conn = conn
        self.fired = False

    def fire(self) -> None:
        self.fired = True
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
