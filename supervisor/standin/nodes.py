"""Multi-node: the group's rendezvous at --dist-init-addr and NCCL-like failure semantics.

Real SGLang's ranks meet through torch.distributed at `--dist-init-addr` during "Init torch
distributed" and then share NCCL communicators. When one node's processes die, the others do
not exit: they block in their next collective until SGLang's watchdog (300 s) fires
(docs/sglang.md, "Multi-node"). The stand-in models that with one TCP connection per follower
to rank 0: rank 0 listens, the others connect (retrying, as the TCP store's client does); a
closed connection marks the peer lost, and from then on the survivors hang, never exit.

Ranks >= 1 run no tokenizer and no HTTP API: only their schedulers and a dummy server whose
/health, /health_generate and /ping always answer 200 (utils/common.py:3624-3650, launched
from entrypoints/engine.py:1234-1284).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from aiohttp import web

_RETRY_S = 0.1


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


class Rendezvous:
    def __init__(self, addr: str, nnodes: int, rank: int, on_lost: Callable[[], None]) -> None:
        self.host, self.port = split_addr(addr)
        self.nnodes = nnodes
        self.rank = rank
        self.on_lost = on_lost
        self.lost = False
        self._joined: list[asyncio.StreamWriter] = []  # the open connections, kept alive
        self._all = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def meet(self) -> None:
        """Until every rank is there (rank 0) or rank 0 is reached (the others)."""
        if self.rank == 0:
            self._server = await asyncio.start_server(self._accepted, self.host, self.port)
            if self.nnodes > 1:
                await self._all.wait()
            return
        while True:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                await asyncio.sleep(_RETRY_S)
                continue
            writer.write(f"{self.rank}\n".encode())
            await writer.drain()
            self._joined.append(writer)  # held: a collected writer closes the connection
            self._watch(reader, writer)
            return

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        if not line or self._all.is_set():
            # A node cannot join a group that already formed (sglang: the whole group
            # relaunches): it is refused.
            writer.close()
            return
        self._joined.append(writer)
        self._watch(reader, writer)
        if len(self._joined) >= self.nnodes - 1:
            self._all.set()

    def _watch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def watch() -> None:
            with contextlib.suppress(OSError):
                while await reader.read(4096):
                    pass
            self.lost = True
            self.on_lost()

        task = asyncio.get_running_loop().create_task(watch())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def dummy_health_app() -> web.Application:
    """utils/common.py:3624 launch_dummy_health_check_server: 200, whatever the schedulers do."""

    async def ok(_: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    for path in ("/ping", "/health", "/health_generate"):
        app.router.add_get(path, ok)
    return app
