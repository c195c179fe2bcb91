"""Answers the real router does not give (500, HTML, garbage, silence): a tiny aiohttp server.

Each must end in a classified failure with a one-line reason, never an exception, and in
bounded time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from aiohttp import web

from supervisor.config import RouterConfig
from supervisor.router import RouterLink
from testkit.loopback import serve_app
from testkit.router import Recorder

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HTML = "<!DOCTYPE html><html><body><h1>502 Bad Gateway</h1></body></html>"


async def serve(handler: Handler) -> tuple[str, Callable[[], Awaitable[None]]]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return await serve_app(app)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


async def link_for(
    handler: Handler, client: httpx.AsyncClient
) -> tuple[RouterLink, Callable[[], Awaitable[None]]]:
    url, stop = await serve(handler)
    cfg = RouterConfig(url=url, worker_url="http://10.1.2.3:30000", drain_timeout=1)
    link = RouterLink(
        cfg, client, Recorder(), request_timeout=0.5, confirm_timeout=0.5, poll_interval=0.05
    )
    return link, stop


async def html_500(_: web.Request) -> web.Response:
    return web.Response(status=500, text=HTML, content_type="text/html")


async def html_200(_: web.Request) -> web.Response:
    return web.Response(status=200, text=HTML, content_type="text/html")


async def wrong_json(_: web.Request) -> web.Response:
    return web.json_response({"workers": "none"})


async def silent(_: web.Request) -> web.Response:
    await asyncio.sleep(30)
    return web.Response(text="late")


async def list_ok_post_garbage(request: web.Request) -> web.Response:
    if request.method == "GET":
        return web.json_response({"workers": [], "total": 0})
    return web.json_response({"status": "accepted"}, status=202)


async def list_ok_delete_500(request: web.Request) -> web.Response:
    if request.method == "GET":
        return web.json_response({"workers": [{"id": "a-b", "url": "http://10.1.2.3:30000"}]})
    return web.Response(status=500, text="Internal Server Error")


CASES = [
    (html_500, "register", "GET /workers answered HTTP 500: <!DOCTYPE html>"),
    (html_200, "register", "not JSON (text/html): is router.url the router's API?"),
    (wrong_json, "register", "JSON without a workers list"),
    (silent, "register", "no answer within 0.5s"),
    (list_ok_post_garbage, "register", "POST /workers answered JSON without a worker_id"),
    (list_ok_delete_500, "deregister", "DELETE /workers/a-b answered HTTP 500"),
]


@pytest.mark.parametrize(("handler", "op", "expected"), CASES, ids=[c[0].__name__ for c in CASES])
async def test_bad_answers_are_classified(
    handler: Handler, op: str, expected: str, client: httpx.AsyncClient
) -> None:
    link, stop = await link_for(handler, client)
    try:
        began = time.monotonic()
        if op == "register":
            assert await link.register_once() is False
        else:
            link.begin_deregister("stop")
            assert await link.settled() is None
        assert time.monotonic() - began < 2.0
        error = link.status()["last_error"]
        assert error is not None and expected in error, error
        assert "\n" not in error
        assert link.status()["registered"] is False
    finally:
        await link.close()
        await stop()
