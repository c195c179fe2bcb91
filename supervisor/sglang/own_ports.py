"""Which of SGLang's access lines are the daemon's own requests: by the client's address.

Every probe, canary, `/metrics` and `/server_info` read makes SGLang's HTTP server (uvicorn)
print one access line, `[2026-12-03 16:00:00] INFO:     127.0.0.1:54321 - "POST /generate
HTTP/1.1" 200 OK` (docs/sglang.md, "Access lines"): four every liveness interval, which drown
the real traffic at info level. The daemon's own lines are told apart by the client address in
them, the local end of the daemon's own connection to SGLang, never by the path, so a user's
`/generate` stays at info.

The local address is learned as the connection is made (httpcore's `connection.connect_tcp`
trace, before a byte of the request is sent), so it is known before SGLang can print the line,
whichever of the pipe and the socket the event loop reads first. It is kept `KEEP_S` after the
connection's last answer; httpx drops an idle connection after 5 s (`keepalive_expiry`), and a
port the kernel hands out again within a minute to another client (TIME_WAIT holds it on our
side meanwhile) would at worst put one of its lines at debug.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import httpx

KEEP_S = 60.0
# More than the daemon ever has open to SGLang (a few); bounds the table against a flood.
MAX_PORTS = 256

# uvicorn's access record as SGLang formats it: `%(client_addr)s - "%(request_line)s"`, the
# client `host:port` (IPv6 without brackets: the port is after the last colon).
_ACCESS = re.compile(r'(?:^|\s)(?P<host>[0-9A-Fa-f.:]+):(?P<port>\d{1,5}) - "[A-Z]+ \S+ HTTP/')


def access_client(line: str) -> tuple[str, int] | None:
    """The client address of an access line of SGLang's HTTP server, or None."""
    m = _ACCESS.search(line, 0, 300)
    return None if m is None else (m["host"], int(m["port"]))


class OwnPorts:
    """The local addresses of the daemon's own connections to SGLang, recently used."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._seen: dict[tuple[str, int], float] = {}

    def transport(self, inner: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncBaseTransport:
        """A transport for the daemon's SGLang client that records each connection's address."""
        return _Recording(inner or httpx.AsyncHTTPTransport(), self)

    def saw(self, addr: Any) -> None:
        if not isinstance(addr, tuple) or len(addr) < 2:
            return
        now = self.clock()
        if len(self._seen) >= MAX_PORTS:
            self._seen = {a: t for a, t in self._seen.items() if now - t < KEEP_S}
        if len(self._seen) < MAX_PORTS:
            self._seen[(str(addr[0]), int(addr[1]))] = now

    def ours(self, line: str) -> bool:
        """Whether `line` is SGLang's access line for one of the daemon's own requests."""
        client = access_client(line)
        if client is None:
            return False
        at = self._seen.get(client)
        return at is not None and self.clock() - at < KEEP_S


class _Recording(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport, ports: OwnPorts) -> None:
        self.inner = inner
        self.ports = ports

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        outer = request.extensions.get("trace")

        async def trace(name: str, info: dict[str, Any]) -> None:
            if name == "connection.connect_tcp.complete":
                stream = info.get("return_value")
                if stream is not None:
                    self.ports.saw(stream.get_extra_info("client_addr"))
            if outer is not None:
                await outer(name, info)

        request.extensions = {**request.extensions, "trace": trace}
        response = await self.inner.handle_async_request(request)
        stream = response.extensions.get("network_stream")
        if stream is not None:  # a kept-alive connection: its address stays fresh
            self.ports.saw(stream.get_extra_info("client_addr"))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()
