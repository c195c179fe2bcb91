"""The slow-client attack on the admin endpoint, and a prober that times /livez meanwhile.

`Trickle`: N loopback connections, each sending a request head one byte every `interval`
seconds, never finishing it; a connection that is closed is opened again at once, so the
attacker always holds N. `Prober`: GET /livez (and /readyz, /metrics in turn) on a fresh
connection every `every` seconds, each timed, each with its own `timeout`.

Both run in their own thread with their own event loop, beside whatever the test does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

HEAD = b"GET /livez HTTP/1.1\r\nHost: kimi-serve\r\nX-Slow: " + b"a" * 100_000


class _Threaded:
    def __init__(self) -> None:
        self.stop = threading.Event()
        self.started = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> _Threaded:
        self.thread.start()
        assert self.started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    async def _main(self) -> None:
        raise NotImplementedError

    async def _until_stopped(self) -> None:
        while not self.stop.is_set():
            await asyncio.sleep(0.05)


class Trickle(_Threaded):
    def __init__(self, host: str, port: int, clients: int = 70, interval: float = 0.3) -> None:
        super().__init__()
        self.host, self.port, self.clients, self.interval = host, port, clients, interval
        self.connections = 0  # opened, reconnections included
        self.cut = 0  # closed by the server (evicted, timed out or refused)
        self.refused = 0  # of those, with a 503 first
        self.held = 0  # open right now

    async def _main(self) -> None:
        tasks = [asyncio.create_task(self._one()) for _ in range(self.clients)]
        self.started.set()
        await self._until_stopped()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self) -> None:
        while not self.stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            self.connections += 1
            self.held += 1
            try:
                await self._trickle(reader, writer)
            finally:
                self.held -= 1
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    async def _trickle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i in range(len(HEAD)):
            try:
                writer.write(HEAD[i : i + 1])
                await writer.drain()
                data = await asyncio.wait_for(reader.read(4096), self.interval)
            except TimeoutError:
                continue  # the server said nothing: keep trickling
            except OSError:
                data = b""
            # An answer (503 at the cap) or the end of the connection: the server cut us.
            self.cut += 1
            self.refused += data.startswith(b"HTTP/1.1 503")
            return


@dataclass
class Probed:
    path: str
    seconds: float
    status: int | None  # None: no answer (timeout, refused, reset)
    error: str = ""


@dataclass
class Summary:
    results: list[Probed] = field(default_factory=list)

    @property
    def failures(self) -> list[Probed]:
        return [r for r in self.results if r.status != 200]

    def quantile(self, q: float, path: str | None = None) -> float:
        times = sorted(r.seconds for r in self.results if path is None or r.path == path)
        if not times:
            return float("nan")
        if len(times) == 1:
            return times[0]
        return statistics.quantiles(times, n=100, method="inclusive")[int(q * 100) - 1]

    def slowest(self, path: str | None = None) -> float:
        return max((r.seconds for r in self.results if path is None or r.path == path), default=0)


class Prober(_Threaded):
    PATHS = ("/livez", "/livez", "/readyz", "/livez", "/metrics")

    def __init__(self, base: str, every: float = 0.1, timeout: float = 5.0) -> None:
        super().__init__()
        self.base, self.every, self.timeout = base.rstrip("/"), every, timeout
        self.summary = Summary()

    async def _main(self) -> None:
        self.started.set()
        url = urllib.parse.urlsplit(self.base)
        host, port = url.hostname or "127.0.0.1", url.port or 80
        i = 0
        while not self.stop.is_set():
            path = self.PATHS[i % len(self.PATHS)]
            i += 1
            # A fresh connection each time, as the kubelet's and a load balancer's probes.
            started = time.monotonic()
            try:
                async with asyncio.timeout(self.timeout):
                    status = await self._get(host, port, path)
                result = Probed(path, time.monotonic() - started, status)
            except (OSError, TimeoutError, ValueError) as exc:
                result = Probed(path, time.monotonic() - started, None, repr(exc))
            self.summary.results.append(result)
            await asyncio.sleep(self.every)

    @staticmethod
    async def _get(host: str, port: int, path: str) -> int:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            )
            await writer.drain()
            answer = await reader.read()  # to the end: the whole answer, as a probe reads it
        finally:
            writer.close()
        if not answer.startswith(b"HTTP/1.1 "):
            raise ValueError(f"not an HTTP answer: {answer[:40]!r}")
        return int(answer[9:12])


class TrickleProcess:
    """`Trickle` in a process of its own, so the attack's own CPU (the interpreter's lock) is
    not counted in the prober's latencies. Its figures arrive as one JSON line at the end."""

    def __init__(self, host: str, port: int, clients: int = 70, interval: float = 0.3) -> None:
        self.args = [host, str(port), str(clients), str(interval)]
        self.stats: dict[str, int] = {}

    def __enter__(self) -> TrickleProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "testkit.slowclients", *self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert self.proc.stdout is not None
        # "holding" once every connection is open, or the server has begun cutting them.
        assert self.proc.stdout.readline().strip() == "holding"
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self.proc.communicate("stop\n", timeout=60)
        self.stats = json.loads(out.strip().splitlines()[-1])


def _serve_attack(host: str, port: int, clients: int, interval: float) -> None:
    with Trickle(host, port, clients, interval) as t:
        while t.held < clients and t.cut == 0:
            time.sleep(0.05)
        print("holding", flush=True)
        sys.stdin.readline()  # until told to stop (or the parent is gone)
    print(json.dumps({"connections": t.connections, "cut": t.cut, "refused": t.refused}))


if __name__ == "__main__":
    _serve_attack(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
