"""The admin HTTP endpoint: /metrics, /readyz, /livez, /status (and POST /restart).

aiohttp serves it on the daemon's own event loop, so an answer from /livez is itself proof
that the loop runs. Loopback by default: it can restart SGLang.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST


class AdminBackend(Protocol):
    def status_document(self) -> dict[str, Any]: ...
    def is_ready(self) -> bool: ...
    def loop_healthy(self) -> bool: ...
    def render_metrics(self) -> bytes: ...
    def request_restart(self) -> str | None: ...


def build_app(backend: AdminBackend) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        body = backend.render_metrics()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def readyz(_: web.Request) -> web.Response:
        ok = backend.is_ready()
        state = backend.status_document()["state"]
        return web.Response(status=200 if ok else 503, text=f"{state}\n")

    async def livez(_: web.Request) -> web.Response:
        ok = backend.loop_healthy()
        return web.Response(status=200 if ok else 503, text="ok\n" if ok else "stalled\n")

    async def status(_: web.Request) -> web.Response:
        return web.json_response(backend.status_document(), dumps=_dumps)

    async def restart(_: web.Request) -> web.Response:
        refused = backend.request_restart()
        if refused:
            return web.json_response({"accepted": False, "error": refused}, status=409)
        return web.json_response({"accepted": True}, status=202)

    app = web.Application()
    app.add_routes(
        [
            web.get("/metrics", metrics),
            web.get("/readyz", readyz),
            web.get("/livez", livez),
            web.get("/status", status),
            web.post("/restart", restart),
        ]
    )
    return app


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)


async def start(backend: AdminBackend, host: str, port: int) -> Callable[[], Any]:
    """Bind and serve; returns the coroutine function that shuts it down. Raises OSError."""
    runner = web.AppRunner(build_app(backend), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner.cleanup
