"""The admin endpoint's aiohttp application: its routes, and the one middleware (`_guard`)
every request passes before any handler: the body limit, then the token for every method other
than GET/HEAD and every GET route not marked open. supervisor/admin/__init__.py serves it behind its
connection gate; its docstring and docs/security.md describe the whole endpoint."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from supervisor import log, untrusted
from supervisor import secret_files as admin_token
from supervisor.admin.redact import (
    CANARY_TEXT_KEYS,
    CLEAN_TEXT_KEYS,
    EVIDENCE_KEY,
    PROCESS_KEYS,
    SGLANG_TEXT_KEYS,
    redact,
)

if TYPE_CHECKING:
    from supervisor.config import Config
    from supervisor.metrics import Metrics


class RequestGate(Protocol):
    """What the middleware tells the connection gate (served, and kept, in
    supervisor/admin/__init__.py): a request starts (+1) or ends (-1) on a connection."""

    def request(self, transport: asyncio.BaseTransport | None, delta: int) -> None: ...


class GroupEndpoint(Protocol):
    """A multi-node replica's coordination (supervisor/daemon/group.py)."""

    def view(self) -> dict[str, Any]: ...
    def end_requested(self, body: Any) -> dict[str, Any]: ...


UPGRADE_OPS = ("accept", "rollback")  # POST /upgrade/<op> (kimi-serve upgrade)


class AdminBackend(Protocol):
    cfg: Config  # admin.token_file
    metrics: Metrics  # admin_denied

    def status_document(self) -> dict[str, Any]: ...
    def is_ready(self) -> bool: ...
    def loop_healthy(self) -> bool: ...
    def render_metrics(self) -> bytes: ...
    def request_restart(self) -> str | None: ...
    # The number of the launch a restart accepted now relaunches (POST /restart's `launch`).
    def next_launch(self) -> int: ...
    # POST /upgrade/accept|rollback: None when queued, else why it is refused.
    def request_upgrade(self, op: str) -> str | None: ...


class Reexec(Protocol):
    """POST /reexec (daemon/handover.py): why not now, or None; then the exec, begun once
    the answer is on its way (the exec closes the client's connection)."""

    def refusal(self) -> str | None: ...
    def begin(self) -> None: ...
    # `/status.daemon` as the request found it: `reexec --wait` waits for the next hand-over.
    def status(self) -> dict[str, Any]: ...


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
GATE: web.AppKey[RequestGate] = web.AppKey("gate")


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


def build_app(
    backend: AdminBackend,
    auth: _Auth,
    *,
    on_drain: Operation | None = None,
    on_undrain: Operation | None = None,
    limits: Limits = Limits(),
    group: GroupEndpoint | None = None,
    on_reexec: Reexec | None = None,
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
                SGLANG_TEXT_KEYS
                | PROCESS_KEYS
                | CLEAN_TEXT_KEYS
                | CANARY_TEXT_KEYS
                | {EVIDENCE_KEY}
            )
        return web.json_response(doc, dumps=_dumps)

    async def restart(_: web.Request) -> web.Response:
        launch = backend.next_launch()
        refused = backend.request_restart()
        if refused:
            return web.json_response({"accepted": False, "error": refused}, status=409)
        # `launch`: the relaunch's number; `restart --wait` waits for that one to be ready.
        return web.json_response({"accepted": True, "launch": launch}, status=202)

    def upgrade(op: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def run(_: web.Request) -> web.Response:
            return answer_upgrade(op)

        return run

    def answer_upgrade(op: str) -> web.Response:
        refused = backend.request_upgrade(op)
        if refused:
            return web.json_response({"accepted": False, "error": refused}, status=409)
        launch = backend.next_launch()
        return web.json_response({"accepted": True, "requested": op, "launch": launch}, status=202)

    async def reexec(request: web.Request) -> web.StreamResponse:
        if on_reexec is None:
            error = "reexec is not supported by this daemon"
            return web.json_response({"accepted": False, "error": error}, status=501)
        refused = on_reexec.refusal()
        if refused:
            return web.json_response({"accepted": False, "error": refused}, status=409)
        answer = {"accepted": True, "daemon": on_reexec.status()}
        response = web.json_response(answer, status=202)
        response.force_close()
        await response.prepare(request)
        await response.write_eof()
        on_reexec.begin()
        return response

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
            web.post("/reexec", reexec),
            *(web.post(f"/upgrade/{op}", upgrade(op)) for op in UPGRADE_OPS),
            web.get("/group", group_view),
            web.post("/group/end", group_end),
        ]
    )
    return app


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
