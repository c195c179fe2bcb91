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
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ipaddress
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from supervisor import admin_token, log, sockowner, untrusted

if TYPE_CHECKING:
    from supervisor.config import Config
    from supervisor.metrics import Metrics


class GroupEndpoint(Protocol):
    """A multi-node replica's coordination (supervisor/group.py)."""

    def view(self) -> dict[str, Any]: ...
    def end_requested(self, body: Any) -> dict[str, Any]: ...


class AdminBackend(Protocol):
    cfg: Config  # admin.token_file
    metrics: Metrics  # admin_denied

    def status_document(self) -> dict[str, Any]: ...
    def is_ready(self) -> bool: ...
    def loop_healthy(self) -> bool: ...
    def render_metrics(self) -> bytes: ...
    def request_restart(self) -> str | None: ...


# What /drain and /undrain call: a JSON-able answer (200), or Refused (409).
Operation = Callable[[], Awaitable[Mapping[str, Any]] | Mapping[str, Any]]


class Refused(Exception):
    """Raised by an Operation that cannot be done now; the message goes to the client."""


class Access(Enum):
    """What a route asks of a client; a handler is marked with `@access(...)` in build_app."""

    OPEN = "open"  # the token is not looked at: Prometheus, load balancers, probes
    VIEW = "view"  # a token is optional; with it the answer is whole, a wrong one is 401
    # The token is required: every method but GET/HEAD, whatever the mark, and every route
    # that carries no mark.
    OPERATE = "operate"


SAFE_METHODS = frozenset({"GET", "HEAD"})
AUTHENTICATED = web.RequestKey("authenticated", bool)
GATE: web.AppKey[_Gate] = web.AppKey("gate")


@dataclass(frozen=True)
class Limits:
    # No endpoint takes a body; 64 KiB leaves room for a future JSON argument.
    max_body_bytes: int = 64 * 1024
    # Prometheus, a probe and a few operators need a handful; the rest are leaks or attacks.
    # Well under the daemon's file descriptors, which SGLang's launch also needs.
    max_connections: int = 64
    # Beyond max_connections, for loopback clients only: Prometheus or a probe on the host,
    # `kimi-serve status`, when remote clients hold every other slot with requests in progress.
    reserve_connections: int = 8
    # A connection must deliver a whole request head within this long of connecting or of the
    # end of its previous request (and a body it is asked for within as long again), however
    # it trickles: the gate's sweep closes it otherwise (so does aiohttp's keep-alive timer,
    # set to the same value).
    request_timeout_s: float = 10.0
    # After an answer, unread request bytes are drained at most this long.
    lingering_s: float = 2.0
    max_line_size: int = 8190
    max_field_size: int = 8190
    max_headers: int = 64


# Keys whose values are text SGLang printed, or may quote it: a fatal log line in `detail`,
# an HTTP error body in a probe's `error`, the log tail. Left out of /status without a token.
SGLANG_TEXT_KEYS = frozenset(
    {"log_tail", "detail", "error", "last_error", "status_line", "text", "stacks", "traceback"}
)

# A process's details beyond pid, program name and whether it is ours: left out of /status
# without a token (the reason may name the user: "runs as alice, not the daemon's uid").
PROCESS_KEYS = frozenset({"cmdline", "user", "reason", "ppid"})
CLEAN_TEXT_KEYS = frozenset({"message", "wedged"})
# The canary's answers (/status.quality.canary): text the model generated, so SGLang's text.
CANARY_TEXT_KEYS = frozenset({"expected", "got"})

UNAUTHORIZED = "401: missing or wrong admin token (Authorization: Bearer <admin.token_file>)\n"


class _Auth:
    """The token, re-read when its file is replaced (a rotation needs no daemon restart)."""

    def __init__(self, path: str, token: admin_token.Token) -> None:
        self.path = path
        self.token: admin_token.Token | None = token
        self.problem: str | None = None

    def check(self, presented: str) -> bool:
        if self.token is None or admin_token.changed(self.token, self.path):
            try:
                self.token, self.problem = admin_token.load(self.path), None
            except admin_token.TokenFileError as exc:
                # Fail closed: nothing mutating until the file is usable again.
                if exc.message != self.problem:
                    log.get().error("admin token file unusable; refusing", error=exc.message)
                self.token, self.problem = None, exc.message
                return False
        return self.token.matches(presented)


class _DeniedLog:
    """At most `burst` lines per `window_s` seconds: a flood of 401s must not flood the log."""

    def __init__(self, burst: int = 10, window_s: float = 60.0) -> None:
        self.burst, self.window_s = burst, window_s
        self.window_start, self.count, self.suppressed = 0.0, 0, 0

    def allow(self, now: float) -> tuple[bool, int]:
        if now - self.window_start >= self.window_s:
            self.window_start, self.count = now, 0
        self.count += 1
        if self.count > self.burst:
            self.suppressed += 1
            return False, 0
        suppressed, self.suppressed = self.suppressed, 0
        return True, suppressed


def _presented(request: web.Request) -> str | None:
    """The bearer token of the request; "" for an Authorization header of another form."""
    header = request.headers.get("Authorization")
    if header is None:
        return None
    scheme, _, value = header.strip().partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def _endpoint(request: web.Request) -> str:
    """A bounded label: the route's path, or `other` for a path no route has."""
    route = request.match_info.route
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else "other"


def redact(doc: Any) -> Any:
    """The /status document without SGLang's text (see SGLANG_TEXT_KEYS), at any depth, and
    with every process on the GPUs as pid, program name and ours-or-foreign only (see
    PROCESS_KEYS): a foreign process's command line and user are someone else's business."""
    if isinstance(doc, dict):
        out = {k: redact(v) for k, v in doc.items() if k not in SGLANG_TEXT_KEYS}
        if "cmdline" in doc:
            out = {k: v for k, v in out.items() if k not in PROCESS_KEYS}
            out["name"] = program_name(str(doc.get("cmdline") or ""))
        if "found" in doc:  # a cleaning report: its message and wedged lines quote them
            out = {k: v for k, v in out.items() if k not in CLEAN_TEXT_KEYS}
        if "got" in doc:  # the canary's expected and received answers
            out = {k: v for k, v in out.items() if k not in CANARY_TEXT_KEYS}
        return out
    if isinstance(doc, list):
        return [redact(v) for v in doc]
    return doc


def program_name(cmdline: str) -> str:
    """What `ps -o comm` would say, near enough: the program's base name, no arguments."""
    first = cmdline.split(maxsplit=1)[0] if cmdline.strip() else ""
    return first.rsplit("/", 1)[-1][:64]


def build_app(
    backend: AdminBackend,
    auth: _Auth,
    *,
    on_drain: Operation | None = None,
    on_undrain: Operation | None = None,
    limits: Limits = Limits(),
    group: GroupEndpoint | None = None,
) -> web.Application:
    denied_log = _DeniedLog()
    logger = log.get()

    def deny(request: web.Request, why: str) -> web.Response:
        endpoint = _endpoint(request)
        backend.metrics.admin_denied.labels(endpoint).inc()
        ok, suppressed = denied_log.allow(time.monotonic())
        if ok:
            logger.warning(
                "admin request denied",
                endpoint=endpoint,
                method=request.method,
                peer=request.remote,
                why=why,
                **({"suppressed": suppressed} if suppressed else {}),
            )
        return web.Response(
            status=401,
            text=UNAUTHORIZED,
            headers={"WWW-Authenticate": 'Bearer realm="kimi-serve admin"'},
        )

    @web.middleware
    async def _guard(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        gate = request.app.get(GATE)
        if gate is None:
            return await _checked(request, handler)
        gate.request(request.transport, +1)
        try:
            return await _checked(request, handler)
        finally:
            gate.request(request.transport, -1)

    async def _checked(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        length = request.content_length
        if length is not None and length > limits.max_body_bytes:
            return web.Response(status=413, text=f"413: body over {limits.max_body_bytes} bytes\n")
        route = request.match_info.route
        if route is None or route.resource is None:
            access = Access.OPEN  # no such route: the 404 reveals nothing
        else:
            # A route that does not say otherwise needs the token, GET included.
            access = getattr(route.handler, "access", Access.OPERATE)
        if request.method not in SAFE_METHODS:
            access = Access.OPERATE
        presented = _presented(request)
        request[AUTHENTICATED] = False
        if access is Access.OPERATE or (access is Access.VIEW and presented is not None):
            if not presented:
                return deny(request, "no token" if presented is None else "not a bearer token")
            if not auth.check(presented):
                why = "wrong token" if auth.problem is None else "token file unusable"
                return deny(request, why)
            request[AUTHENTICATED] = True
        return await handler(request)

    def access(level: Access) -> Callable[[Any], Any]:
        def mark(handler: Any) -> Any:
            handler.access = level
            return handler

        return mark

    @access(Access.OPEN)
    async def metrics(_: web.Request) -> web.Response:
        body = backend.render_metrics()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @access(Access.OPEN)
    async def readyz(_: web.Request) -> web.Response:
        ok = backend.is_ready()
        state = backend.status_document()["state"]
        return web.Response(status=200 if ok else 503, text=f"{state}\n")

    @access(Access.OPEN)
    async def livez(_: web.Request) -> web.Response:
        ok = backend.loop_healthy()
        return web.Response(status=200 if ok else 503, text="ok\n" if ok else "stalled\n")

    @access(Access.VIEW)
    async def status(request: web.Request) -> web.Response:
        doc = backend.status_document()
        if not request[AUTHENTICATED]:
            doc = redact(doc)
            doc["redacted"] = sorted(
                SGLANG_TEXT_KEYS | PROCESS_KEYS | CLEAN_TEXT_KEYS | CANARY_TEXT_KEYS
            )
        return web.json_response(doc, dumps=_dumps)

    async def restart(_: web.Request) -> web.Response:
        refused = backend.request_restart()
        if refused:
            return web.json_response({"accepted": False, "error": refused}, status=409)
        return web.json_response({"accepted": True}, status=202)

    def operation(name: str, op: Operation | None) -> Callable[[web.Request], Awaitable[Any]]:
        async def run(_: web.Request) -> web.Response:
            if op is None:
                return web.json_response(
                    {"accepted": False, "error": f"{name} is not supported by this daemon"},
                    status=501,
                )
            try:
                result = op()
                if inspect.isawaitable(result):
                    result = await result
            except Refused as exc:
                return web.json_response({"accepted": False, "error": str(exc)}, status=409)
            except Exception as exc:  # one line for the client and the log, never a traceback
                logger.error(f"admin {name} failed", error=repr(exc))
                return web.json_response({"accepted": False, "error": repr(exc)}, status=500)
            return web.json_response(dict(result), dumps=_dumps)

        return run

    # GET /group and POST /group/end carry no mark: the token is required for both, GET
    # included (docs/multinode.md): peers on other hosts are never trusted without it.
    async def group_view(_: web.Request) -> web.Response:
        if group is None:
            return web.json_response({"error": "not a multi-node replica"}, status=404)
        return web.json_response(group.view(), dumps=_dumps)

    async def group_end(request: web.Request) -> web.Response:
        if group is None:
            return web.json_response({"error": "not a multi-node replica"}, status=404)
        try:
            async with asyncio.timeout(limits.request_timeout_s):
                raw = await request.read()
        except TimeoutError:
            return web.json_response({"accepted": False, "error": "body too slow"}, status=408)
        try:
            body = untrusted.loads(raw)
        except ValueError:
            return web.json_response({"accepted": False, "error": "body is not JSON"}, status=400)
        return web.json_response(group.end_requested(body), dumps=_dumps)

    app = web.Application(middlewares=[_guard], client_max_size=limits.max_body_bytes)
    app.add_routes(
        [
            web.get("/metrics", metrics),
            web.get("/readyz", readyz),
            web.get("/livez", livez),
            web.get("/status", status),
            web.post("/restart", restart),
            web.post("/drain", operation("drain", on_drain)),
            web.post("/undrain", operation("undrain", on_undrain)),
            web.get("/group", group_view),
            web.post("/group/end", group_end),
        ]
    )
    return app


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)


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


async def serve(app: web.Application, host: str, port: int, limits: Limits = Limits()) -> Served:
    """Bind and serve `app` with `limits`. Raises OSError."""
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
        listener = await loop.create_server(gate.factory(server), host, port, reuse_address=True)
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

    return Served(int(listener.sockets[0].getsockname()[1]), gate, stop)


async def open_endpoint(
    backend: AdminBackend,
    host: str,
    port: int,
    *,
    on_drain: Operation | None = None,
    on_undrain: Operation | None = None,
    limits: Limits = Limits(),
    group: GroupEndpoint | None = None,
) -> Served:
    """Create or check the token file, then bind and serve. Raises OSError
    (admin_token.TokenFileError for the token file, before anything is bound)."""
    path = backend.cfg.admin.token_file
    auth = _Auth(path, admin_token.ensure(path))
    log.get().info("admin token", file=path)  # where it is, never what it is
    app = build_app(
        backend, auth, on_drain=on_drain, on_undrain=on_undrain, limits=limits, group=group
    )
    return await serve(app, host, port, limits)
