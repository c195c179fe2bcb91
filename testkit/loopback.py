"""Loopback HTTP servers a test writes itself (what a peer may answer): `serve_app(app)` around
aiohttp handlers, `read_request(reader)` for one written on asyncio streams."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web


async def serve_app(app: web.Application) -> tuple[str, Callable[[], Awaitable[None]]]:
    """`app` served on a free loopback port: its URL and the coroutine that stops it."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return f"http://127.0.0.1:{port}", runner.cleanup


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 request off the stream: its head and its Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + await reader.readexactly(length)
