"""The port watcher: when SGLang's HTTP port takes connections."""

from __future__ import annotations

import asyncio
import contextlib


async def wait_port_open(host: str, port: int, interval: float = 0.1) -> None:
    """Returns once a TCP connect to host:port succeeds."""
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(interval)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return
