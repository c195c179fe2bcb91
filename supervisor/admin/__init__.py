"""The admin HTTP endpoint: /metrics, /readyz, /livez, /status, and POST /restart, /drain,
/undrain.

aiohttp serves it on the daemon's own event loop, so an answer from /livez is itself proof
that the loop runs. Every request passes one middleware (`_guard`) before any handler: every
method other than GET/HEAD needs the bearer token of `admin.token_file`, whatever the route,
and so does a GET route not marked open, so a route added later cannot forget it. GET
/status with the token is whole; without one it leaves out what SGLang printed (`redact`).
See docs/security.md for the threat model.

The endpoint must stay responsive, and never stall the loop, whatever a client sends: bodies
are bounded (`Limits.max_body_bytes`), a connection that does not deliver a whole request head
within `Limits.request_timeout_s` of connecting or of its last answer is closed, however it
trickles (slowloris), and at `Limits.max_connections` a newcomer takes the place of the
connection that has waited longest for its request head (`_Gate`), with a reserve for
loopback clients; so neither a leak nor a slow client can take the daemon's file
descriptors or lock out /livez, /readyz and /metrics.

The application (routes, `_guard`, `Limits`) is supervisor/admin/app.py, what /status leaves
out without the token supervisor/admin/redact.py; this module serves it behind `_Gate`, and
the names callers and tests use are importable from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from supervisor import log, secret_files
from supervisor.admin import sockowner
from supervisor.admin.app import AUTHENTICATED as AUTHENTICATED
from supervisor.admin.app import GATE as GATE
from supervisor.admin.app import SAFE_METHODS as SAFE_METHODS
from supervisor.admin.app import UNAUTHORIZED as UNAUTHORIZED
from supervisor.admin.app import Access as Access
from supervisor.admin.app import AdminBackend as AdminBackend
from supervisor.admin.app import GroupEndpoint as GroupEndpoint
from supervisor.admin.app import Limits as Limits
from supervisor.admin.app import Operation as Operation
from supervisor.admin.app import Reexec as Reexec
from supervisor.admin.app import Refused as Refused
from supervisor.admin.app import _Auth as _Auth
from supervisor.admin.app import _DeniedLog as _DeniedLog
from supervisor.admin.app import build_app as build_app
from supervisor.admin.redact import CANARY_TEXT_KEYS as CANARY_TEXT_KEYS
from supervisor.admin.redact import CLEAN_TEXT_KEYS as CLEAN_TEXT_KEYS
from supervisor.admin.redact import PROCESS_KEYS as PROCESS_KEYS
from supervisor.admin.redact import SGLANG_TEXT_KEYS as SGLANG_TEXT_KEYS
from supervisor.admin.redact import WITHHELD as WITHHELD
from supervisor.admin.redact import program_name as program_name
from supervisor.admin.redact import redact as redact

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 44\r\n"
    b"Connection: close\r\n\r\n503: too many connections to the admin port\n"
)


FRESH_S = 0.5


class _Gate:
    """Open connections, at most `limit`, plus `reserve` more for loopback clients.

    A connection counts as *pending* from its start, or from the end of its last request, until
    its next request head is complete: that is what a slow client holds, whatever it trickles.
    At the limit a newcomer takes the place of the connection pending longest, so a client
    that hoards connections, or feeds each a byte at a time, cannot lock out Prometheus, a
    probe or an operator: their requests arrive whole in one packet and are under way before
    their connection is the oldest pending one. Only when no connection is pending (every one
    has a request in progress) is the newcomer refused (503); a loopback newcomer (Prometheus
    or a probe on the host, `kimi-serve status`) first gets one of the `reserve` slots, which
    remote clients never take. Apart from that, `sweep` closes a connection pending longer
    than `deadline_s`: a whole request head within that time, or the connection goes."""

    def __init__(self, limit: int, reserve: int = 0, deadline_s: float = 10.0) -> None:
        self.limit = limit
        self.reserve = reserve
        self.deadline_s = deadline_s
        self.live: set[_Counted] = set()
        self.by_transport: dict[asyncio.BaseTransport, _Counted] = {}
        self.refused = 0
        self.evicted = 0
        self.expired = 0
        self._logged_at = -60.0

    @property
    def open(self) -> int:
        return len(self.live)

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            # Admitted or refused in connection_made, once the peer's address is known.
            return _Counted(inner(), self, time.monotonic())

        return make

    def admit(self, conn: _Counted, loopback: bool) -> bool:
        """At connection_made: whether `conn` may have a slot (then it is counted in)."""
        room = self.limit + (self.reserve if loopback else 0)
        now = time.monotonic()
        if len(self.live) >= room and not self._evict_one(now):
            # Every pending connection is fresh (a flood's batch, a probe among it): over the
            # limit for now, up to twice it; the sweep trims back once they are not. With no
            # pending connection at all (every one has a request in progress): refused.
            fresh = any(c.fresh(now) for c in self.live)
            if not fresh or len(self.live) >= 2 * (self.limit + self.reserve):
                self.refused += 1
                self._warn(now)
                return False
        self.live.add(conn)
        return True

    def _evict_one(self, now: float) -> bool:
        """Close the connection pending longest, of those not fresh (a connection that has
        sent nothing for under FRESH_S: the loop may accept a flood's batch before it reads
        the probe that arrived among it, whole, in its first packet)."""
        pending = [
            c for c in self.live if c.transport is not None and c.pending() and not c.fresh(now)
        ]
        if not pending:
            return False
        self.evicted += 1
        min(pending, key=lambda c: c.since).close()
        return True

    def sweep(self) -> None:
        """Close every connection pending longer than `deadline_s`, then trim back to the
        limit what a flood put over it."""
        now = time.monotonic()
        for c in [c for c in self.live if c.pending() and now - c.since > self.deadline_s]:
            self.expired += 1
            c.close()
        while len(self.live) > self.limit + self.reserve and self._evict_one(now):
            pass

    def _warn(self, now: float) -> None:
        if now - self._logged_at >= 60.0:
            self._logged_at = now
            log.get().warning(
                "admin connections over the limit, all busy; refusing",
                limit=self.limit,
                refused_total=self.refused,
            )

    def request(self, transport: asyncio.BaseTransport | None, delta: int) -> None:
        """A request starts (+1) or ends (-1) on this connection: not pending meanwhile, and
        pending again, from now, once it ends."""
        conn = self.by_transport.get(transport) if transport is not None else None
        if conn is not None:
            conn.in_flight += delta
            if delta < 0 and conn.in_flight == 0:
                conn.since, conn.head = time.monotonic(), b""


class _Counted(asyncio.Protocol):
    """aiohttp's protocol, unchanged, with the connection counted in and out and watched for
    the end of a request head (an empty line), to tell a request on its way from one held."""

    def __init__(self, inner: asyncio.Protocol, gate: _Gate, now: float) -> None:
        self.inner, self.gate, self.since = inner, gate, now
        self.transport: asyncio.Transport | None = None
        self.in_flight = 0
        self.head: bytes | None = b""  # the last bytes seen of a head; None once it is whole
        self.busy = False  # refused at the limit: answered 503, never handed to aiohttp

    def pending(self) -> bool:
        return self.in_flight == 0 and self.head is not None and not self.busy

    def fresh(self, now: float) -> bool:
        return self.head == b"" and self.in_flight == 0 and now - self.since < FRESH_S

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.gate.admit(self, _is_loopback(transport.get_extra_info("peername"))):
            self.busy = True
            transport.write(_BUSY)
            transport.close()
            return
        self.gate.by_transport[transport] = self
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.busy:
            return
        if self.head is not None:
            seen = self.head + data
            # The empty line may come split over packets: keep the last 3 bytes.
            self.head = None if b"\r\n\r\n" in seen else seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.busy else self.inner.eof_received()

    def pause_writing(self) -> None:
        if not self.busy:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.busy:
            self.inner.resume_writing()

    def close(self) -> None:
        self.forget()
        if self.transport is not None:
            self.transport.abort()

    def forget(self) -> None:
        self.gate.live.discard(self)
        if self.transport is not None:
            self.gate.by_transport.pop(self.transport, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.forget()
        if not self.busy:
            self.inner.connection_lost(exc)


def _is_loopback(peer: Any) -> bool:
    try:
        return ipaddress.ip_address(str(peer[0]).split("%")[0]).is_loopback
    except (TypeError, IndexError, ValueError):
        return False


class _OneLine(logging.Handler):
    """aiohttp's own log (a malformed request, a handler that raised) as one line without a
    traceback, at most `_DeniedLog`'s rate: garbage from a client must not flood the log or
    put tracebacks in front of an operator."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.limiter = _DeniedLog()

    def emit(self, record: logging.LogRecord) -> None:
        ok, suppressed = self.limiter.allow(time.monotonic())
        if not ok:
            return
        exc = record.exc_info[1] if record.exc_info else None
        detail = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else ""
        log.get().warning(
            "admin request failed",
            message=record.getMessage(),
            error=f"{type(exc).__name__}: {detail}" if exc is not None else None,
            **({"suppressed": suppressed} if suppressed else {}),
        )


def _server_logger() -> logging.Logger:
    logger = logging.getLogger("kimi-serve.admin.http")
    if not logger.handlers:
        logger.addHandler(_OneLine())
        logger.propagate = False
    return logger


def holder(host: str, port: int) -> str:
    """For the message of a failed bind: who holds host:port, as the kernel lists it."""
    with contextlib.suppress(OSError, ValueError):
        uids = sockowner.listener_uids(host, port)
        if uids:
            who = ", ".join(sockowner.user_name(u) for u in sorted(uids))
            return f" (held by {who}; `ss -ltnpe 'sport = :{port}'` shows the process)"
    return ""


@dataclass
class Served:
    """A running admin endpoint: its port (for port 0) and how to stop it."""

    port: int
    gate: _Gate
    stop: Callable[[], Awaitable[None]]
    # A hand-over (daemon/handover.py): the listening socket for the next exec, and back.
    hand_over: Callable[[], Awaitable[int]] | None = None
    resume: Callable[[int], Awaitable[None]] | None = None


# How long a hand-over waits for the admin requests in flight to be answered.
HAND_OVER_DRAIN_S = 2.0
# How long a connection accepted just before a hand-over has to send its request (its answer
# then comes from this program); an idle keep-alive one is closed after it.
HAND_OVER_GRACE_S = 0.5


async def serve(
    app: web.Application,
    host: str,
    port: int,
    limits: Limits = Limits(),
    sock: socket.socket | None = None,
) -> Served:
    """Bind and serve `app` with `limits` (on `sock`, a listening socket a hand-over passed
    on, when given). Raises OSError."""
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=limits.request_timeout_s,
        lingering_time=limits.lingering_s,
        max_line_size=limits.max_line_size,
        max_field_size=limits.max_field_size,
        max_headers=limits.max_headers,
        logger=_server_logger(),
    )
    gate = _Gate(limits.max_connections, limits.reserve_connections, limits.request_timeout_s)
    app[GATE] = gate
    await runner.setup()
    server = runner.server
    assert server is not None
    loop = asyncio.get_running_loop()
    try:
        if sock is not None:
            listener = await loop.create_server(gate.factory(server), sock=sock)
        else:
            listener = await loop.create_server(
                gate.factory(server), host, port, reuse_address=True
            )
    except OSError:
        await runner.cleanup()
        raise

    async def sweep() -> None:
        while True:
            await asyncio.sleep(min(1.0, limits.request_timeout_s / 4))
            gate.sweep()

    sweeper = loop.create_task(sweep())

    async def stop() -> None:
        sweeper.cancel()
        listener.close()
        await runner.cleanup()

    async def hand_over() -> int:
        # A duplicate keeps the socket listening once the server lets go of it: connections
        # that come meanwhile wait in the kernel's queue for the next exec, none is refused.
        # Requests in flight are answered, idle keep-alive connections closed (the exec would
        # cut them without a word).
        fd = os.dup(listener.sockets[0].fileno())
        listener.close()
        # A connection accepted just before the close is made a moment later (asyncio's
        # accept callback): each round answers those seen so far, until none is new.
        deadline = loop.time() + HAND_OVER_DRAIN_S
        answered: set[Any] = set()
        while (left := deadline - loop.time()) > 0:
            await asyncio.sleep(0)
            new = [c for c in server.connections if c not in answered]
            if not new:
                break
            answered.update(new)
            # A connection just accepted may not have sent its request yet: shut down now, it
            # would be closed unanswered (the client sees a reset). Each gets HAND_OVER_GRACE_S
            # to send it and be answered (a `Connection: close` client is then gone); only what
            # is still open after that (an idle keep-alive) is shut down.
            grace = loop.time() + min(HAND_OVER_GRACE_S, left)
            while loop.time() < grace and any(c in server.connections for c in new):
                await asyncio.sleep(0.01)
            left = max(0.0, deadline - loop.time())
            still = [c for c in new if c in server.connections]
            await asyncio.gather(*(c.shutdown(left) for c in still), return_exceptions=True)
        return fd

    async def resume(fd: int) -> None:
        nonlocal listener
        listener = await loop.create_server(gate.factory(server), sock=socket.socket(fileno=fd))

    port = int(listener.sockets[0].getsockname()[1])
    return Served(port, gate, stop, hand_over, resume)


async def open_endpoint(
    backend: AdminBackend,
    host: str,
    port: int,
    *,
    on_drain: Operation | None = None,
    on_undrain: Operation | None = None,
    limits: Limits = Limits(),
    group: GroupEndpoint | None = None,
    on_reexec: Reexec | None = None,
    sock: socket.socket | None = None,
) -> Served:
    """Create or check the token file, then bind and serve. Raises OSError
    (secret_files.TokenFileError for the token file, before anything is bound)."""
    path = backend.cfg.admin.token_file
    auth = _Auth(path, secret_files.ensure(path))
    log.get().info("admin token", file=path)  # where it is, never what it is
    app = build_app(
        backend,
        auth,
        on_drain=on_drain,
        on_undrain=on_undrain,
        limits=limits,
        group=group,
        on_reexec=on_reexec,
    )
    return await serve(app, host, port, limits, sock)
