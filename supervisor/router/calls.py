"""The router link's base: its configuration and state, and the one way it calls the router.

Every call is bounded (request_timeout, answers up to MAX_ANSWER_BYTES) and every failure is a
`Failure`, never an exception: it is counted (`kimi_serve_router_errors_total{op}`), logged
once per change and shown in `/status.router.last_error` (`_fail`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from supervisor import secret_files
from supervisor.config import RouterConfig
from supervisor.router.api import Failure, Worker, key_in_clear, parse_workers
from supervisor.router.state import Log, RouterMetrics, RouterState
from supervisor.sglang.drain_wait import DrainResult

MAX_ANSWER_BYTES = 4 << 20  # a worker list of a few hundred replicas is well below this


class RouterCalls:
    """The link's settings and state, its calls to the router and their bookkeeping; the
    registration (`registration.Registration`), the removal (`removal.Removal`) and the
    background loop (`link.RouterLink`) are built on it."""

    def __init__(
        self,
        cfg: RouterConfig,
        client: httpx.AsyncClient,
        log: Log,
        metrics: RouterMetrics | None = None,
        sglang_url: str | None = None,
        *,
        request_timeout: float = 3.0,
        confirm_timeout: float = 5.0,
        settle_timeout: float = 15.0,
        recheck_interval: float = 5.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        poll_interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
    ) -> None:
        assert cfg.url is not None, "RouterLink needs router.url"
        self.cfg = cfg
        self.base = cfg.url.rstrip("/")
        self.client = client
        self.log = log
        self.metrics = metrics
        self.sglang_url = (sglang_url or cfg.worker_url).rstrip("/")
        self.state = RouterState(cfg.url, cfg.worker_url)
        self._warned_clear = False
        self.request_timeout = request_timeout
        self.confirm_timeout = confirm_timeout
        self.settle_timeout = settle_timeout
        self.recheck_interval = recheck_interval
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.poll_interval = poll_interval
        self.clock = clock
        self.wall = wall
        self.rng = rng
        self._headers = self._auth_headers()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._pending: asyncio.Task[DrainResult | None] | None = None
        self._lock = asyncio.Lock()
        self._attempt = 0
        self._closed = False

    def status(self) -> dict[str, Any]:
        return self.state.to_status()

    async def list_workers(self) -> list[Worker] | Failure:
        got = await self._call("list", "GET", "/workers")
        if isinstance(got, Failure):
            return got
        return parse_workers(*got)

    async def _call(
        self, op: str, method: str, path: str, json: Any = None
    ) -> tuple[int, bytes, str] | Failure:
        url = self.base + path
        limit = self.request_timeout
        try:
            async with asyncio.timeout(limit):
                async with self.client.stream(
                    method, url, json=json, headers=self._headers, timeout=limit
                ) as response:
                    chunks: list[bytes] = []
                    size = 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > MAX_ANSWER_BYTES:
                            return Failure(op, "malformed", f"{method} {path}: answer too large")
                        chunks.append(chunk)
                    ctype = response.headers.get("content-type", "")
                    return response.status_code, b"".join(chunks), ctype
        except (TimeoutError, httpx.TimeoutException):
            return Failure(op, "timeout", f"{method} {url}: no answer within {limit:g}s")
        except httpx.ConnectError as exc:
            return Failure(op, "connect", f"{method} {url}: cannot connect ({exc or 'refused'})")
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            return Failure(op, "connect", f"bad router.url {self.base!r}: {exc}")
        except (httpx.HTTPError, OSError, ValueError) as exc:
            msg = str(exc) or type(exc).__name__
            return Failure(op, "connect", f"{method} {url}: connection lost ({msg})")

    def _auth_headers(self) -> dict[str, str]:
        path = self.cfg.api_key_file
        if path is None:
            return {}
        try:
            # Read each time (a rotation needs no restart), with the token file's checks.
            token = secret_files.read_secret(path, "router.api_key_file")
        except secret_files.TokenFileError as exc:
            self._fail(Failure("register", "config", exc.message))
            return {}
        if token and not self._warned_clear:
            self._warned_clear = True
            warning = key_in_clear(self.cfg)
            if warning:
                self.log.warning(warning)
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _confirmed(self, wid: str) -> None:
        if not self.state.registered or self.state.worker_id != wid:
            self.log.info("router: registered", worker_url=self.cfg.worker_url, worker_id=wid)
        self.state.worker_id = wid
        self._set_registered(True)
        self._ok()

    def _set_registered(self, registered: bool) -> None:
        self.state.registered = registered
        if self.metrics is not None:
            self.metrics.set_router_registered(registered)

    def _ok(self) -> None:
        self.state.last_ok_at = self.wall()

    def _fail(self, failure: Failure) -> None:
        self.state.errors[failure.op] = self.state.errors.get(failure.op, 0) + 1
        if self.metrics is not None:
            self.metrics.router_error(failure.op)
        line = f"{failure.op}: {failure.message}"
        if line != self.state.last_error:  # one log line per change, not per retry
            self.log.warning(
                "router call failed", op=failure.op, kind=failure.kind, error=failure.message
            )
        self.state.last_error = line
        self.state.last_error_at = self.wall()
