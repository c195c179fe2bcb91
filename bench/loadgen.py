"""A load generator for a fleet behind the router: what users feel, counted.

It sends plain and streaming `/generate` requests through the router for as long as it runs,
`concurrency` at a time, and records every request: when it started and ended, whether it was a
stream, how it ended. A stream that delivered its first chunk and then ended without SGLang's
final `data: [DONE]` (or a finish_reason) is **cut**: once bytes have reached the user the
router cannot retry it elsewhere. A request answered non-200, or whose connection failed before
any byte, is **failed**.

Marks (`mark("restart")`) split the run into phases, so one run can report "during the
restart" and "after the replica was out of the list" separately. What reached which replica
is counted on the replica's side (the stand-in logs every request it served); this module
counts what the client saw.

Used by the fleet tests and `bench` (docs/fleet.md, docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

PLAIN_OK, STREAM_OK, FAILED, CUT = "ok", "stream_ok", "failed", "cut"


@dataclass(frozen=True)
class Outcome:
    n: int
    stream: bool
    started: float  # time.time()
    ended: float
    result: str  # ok | stream_ok | failed | cut
    status: int | None
    chunks: int  # stream chunks received (0 for plain)
    error: str | None = None


@dataclass
class Stats:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    streams: int = 0
    streams_ok: int = 0
    streams_cut: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def add(self, o: Outcome) -> None:
        self.sent += 1
        self.streams += o.stream
        self.ok += o.result in (PLAIN_OK, STREAM_OK)
        self.streams_ok += o.result == STREAM_OK
        self.streams_cut += o.result == CUT
        self.failed += o.result not in (PLAIN_OK, STREAM_OK, CUT)
        if o.error:
            self.errors[o.error[:120]] += 1

    def to_dict(self) -> dict[str, Any]:
        counts = ("sent", "ok", "failed", "streams", "streams_ok", "streams_cut")
        return {k: getattr(self, k) for k in counts} | {"errors": dict(self.errors.most_common(5))}


def stream_complete(events: list[bytes]) -> bool:
    """SGLang's streaming /generate ends with `data: [DONE]`; the chunk before it carries a
    finish_reason. Either proves the stream ended on purpose."""
    for raw in reversed(events):
        data = raw.strip()
        if data == b"[DONE]":
            return True
        try:
            doc = json.loads(data)
        except ValueError:
            continue
        meta = doc.get("meta_info") if isinstance(doc, dict) else None
        if isinstance(meta, dict) and meta.get("finish_reason"):
            return True
    return False


class LoadGenerator:
    def __init__(
        self,
        base_url: str,
        *,
        concurrency: int = 4,
        stream_every: int = 2,  # every Nth request streams (0: none)
        max_new_tokens: int = 16,
        timeout: float = 30.0,
    ) -> None:
        self.base = base_url.rstrip("/")
        self.concurrency = concurrency
        self.stream_every = stream_every
        self.max_new_tokens = max_new_tokens
        self.timeout = timeout
        self.outcomes: list[Outcome] = []
        self._counter = itertools.count(1)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._client: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------ control

    async def start(self) -> LoadGenerator:
        self._client = httpx.AsyncClient(
            trust_env=False,
            timeout=self.timeout,
            limits=httpx.Limits(max_connections=self.concurrency * 2),
        )
        self._tasks = [asyncio.ensure_future(self._worker()) for _ in range(self.concurrency)]
        return self

    async def stop(self) -> Stats:
        """Let the requests in flight finish (they count), then stop."""
        self._stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*self._tasks), self.timeout + 5)
        for t in self._tasks:
            t.cancel()
        if self._client is not None:
            await self._client.aclose()
        return self.stats()

    def mark(self, name: str) -> float:
        """The time a phase named `name` begins (for `stats(since=...)`)."""
        return time.time()

    def stats(self, since: float | None = None, until: float | None = None) -> Stats:
        """Requests that *started* in [since, until)."""
        s = Stats()
        for o in self.outcomes:
            if (since is None or o.started >= since) and (until is None or o.started < until):
                s.add(o)
        return s

    async def wait_for(self, n: int, timeout: float = 30.0) -> None:
        """Until at least n requests have ended (a barrier for tests)."""
        deadline = time.monotonic() + timeout
        while len(self.outcomes) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.outcomes)} of {n} requests ended")
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ requests

    async def _worker(self) -> None:
        while not self._stop.is_set():
            n = next(self._counter)
            stream = self.stream_every > 0 and n % self.stream_every == 0
            self.outcomes.append(await self._one(n, stream))

    async def _one(self, n: int, stream: bool) -> Outcome:
        assert self._client is not None
        started = time.time()
        status: int | None = None
        chunks = 0
        events: list[bytes] = []

        def outcome(result: str, error: str | None = None) -> Outcome:
            return Outcome(n, stream, started, time.time(), result, status, chunks, error)

        payload = {
            "text": f"Request {n}: say hello",
            "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0},
            "stream": stream,
        }
        try:
            async with self._client.stream("POST", self.base + "/generate", json=payload) as r:
                status = r.status_code
                if status != 200:
                    body = (await r.aread())[:200].decode("utf-8", "replace")
                    return outcome(FAILED, f"HTTP {status}: {body}")
                if not stream:
                    doc = json.loads(await r.aread())
                    if isinstance(doc, dict) and isinstance(doc.get("meta_info"), dict):
                        return outcome(PLAIN_OK)
                    return outcome(FAILED, "malformed answer")
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        chunks += 1
                        events.append(line[5:].encode())
        except (httpx.HTTPError, OSError, ValueError) as exc:
            return outcome(CUT if stream and chunks else FAILED, f"{type(exc).__name__}: {exc}")
        if stream_complete(events):
            return outcome(STREAM_OK)
        return outcome(CUT if chunks else FAILED, "stream ended without [DONE]")
