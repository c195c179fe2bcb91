"""Registration with the router in front of a fleet (sglang-router 0.3.x / SMG), as effects.

The router's own health check is SGLang's 1-token `/health` (every 60 s by default): it keeps
sending users to a replica whose decode is broken. So kimi-serve decides who is in the router's
worker list: this SGLang is registered only while the machine says `ready`, and taken out,
with the removal confirmed by the router's list, before anything stops it (docs/fleet.md).

Facts about the router's API this module relies on (measured on sglang-router 0.3.2):
- `POST /workers {"url": U}` answers 202 with a `worker_id`; the worker appears in
  `GET /workers` only after the router's own checks of U pass (in the background), and a
  second POST of a listed URL answers the same id.
- `DELETE /workers/<id>` answers 202 and the entry leaves the list; an unknown id answers 404.
  A DELETE that arrives while the router is still adding the worker is lost: the worker is
  listed afterwards anyway. Hence the reconciling loop below, which keeps comparing the list
  with what we want until it agrees, whatever the router did meanwhile.
- A restarted router has forgotten every worker (and its ids).

And on SMG 1.13 (`smg` on PyPI; tests/router/test_smg.py measures each):
- `POST /workers` answers 202 with a `worker_id` too; SMG's add job lists the worker once
  U's `/health` passed, polling it every `--worker-startup-check-interval` (default 30 s). A
  worker it is adding is not listed (or listed `pending`, routed nothing: not registered
  yet), and a DELETE of it is lost as above.
- A second POST answers 409 `WORKER_CREATE_IN_PROGRESS` while SMG adds U, 409
  `WORKER_ALREADY_EXISTS` once U is listed: read as "known" (`api.Known`), the link then
  waits for the listed entry instead of failing.
- `DELETE` keeps the entry listed as `draining` (routed nothing) for SMG's drain settle time,
  5 s, then drops it; a POST for U answers 409 meanwhile. The link counts a draining entry as
  removed, registers again only once it is gone (`_until_left`, at most settle_timeout), and
  never DELETEs it again: SMG would end the drain of the old requests at once.
- With no worker listed SMG answers 404 `model_not_found`; with only a draining one 503
  `no_available_workers`.

Nothing here raises into the caller: every failure is classified, logged once per change,
counted (`kimi_serve_router_errors_total{op}`) and shown in `/status.router.last_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from supervisor import secret_files as admin_token
from supervisor.config import RouterConfig
from supervisor.router.api import (
    Failure,
    Known,
    Worker,
    _snip,
    backoff,
    key_in_clear,
    parse_added,
    parse_workers,
    same_url,
)
from supervisor.sglang.drain_wait import DrainResult, wait_idle

MAX_ANSWER_BYTES = 4 << 20  # a worker list of a few hundred replicas is well below this
SETTLE_POLL = 0.25  # the list polled while SMG drains our old entry: it lasts seconds


class RouterMetrics(Protocol):
    def set_router_registered(self, registered: bool) -> None: ...
    def router_error(self, op: str) -> None: ...


class Log(Protocol):
    def info(self, event: str, **kw: Any) -> Any: ...
    def warning(self, event: str, **kw: Any) -> Any: ...


@dataclass
class RouterState:
    """What `/status.router` shows. Only RouterLink writes it."""

    url: str
    worker_url: str
    registered: bool = False  # confirmed by the router's list
    worker_id: str | None = None
    wanted: bool = False  # the machine wants us registered (ready)
    last_error: str | None = None
    last_error_at: float | None = None
    last_ok_at: float | None = None
    last_drain: dict[str, Any] | None = None
    errors: dict[str, int] = field(default_factory=dict)

    def to_status(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "worker_url": self.worker_url,
            "registered": self.registered,
            "worker_id": self.worker_id,
            "wanted": self.wanted,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "last_ok_at": self.last_ok_at,
            "last_drain": self.last_drain,
        }


def unlinked_status() -> dict[str, Any]:
    """`/status.router` without router.url: the same keys, so a client reads one shape;
    `url` and `worker_url` null, nothing registered."""
    return {**RouterState(url="", worker_url="").to_status(), "url": None, "worker_url": None}


class RouterLink:
    """Keeps the router's worker list in line with what the machine wants.

    `want_registered()` / `begin_deregister()` are called from the daemon's (synchronous)
    action loop and return at once; the work runs in one background task per link, so calls
    never interleave. `settled()` is what a stop awaits: it returns when the last requested
    deregistration (and drain) is done or has given up, always within a bounded time.
    """

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

    # ------------------------------------------------------------------ the daemon's calls

    def want_registered(self) -> None:
        """Register (in the background, retried with backoff until it holds) and keep it so:
        a router that restarted and forgot us is noticed at the next recheck."""
        if self._closed:
            return
        self.state.wanted = True
        self._attempt = 0
        self._ensure_loop()
        self._wake.set()

    def begin_deregister(
        self, reason: str, wait_idle: bool = False
    ) -> asyncio.Task[DrainResult | None]:
        """Take this SGLang out of the router now, confirm it through `GET /workers`, then
        (wait_idle) wait until SGLang has no running or queued request, bounded by
        router.drain_timeout. Returns the task; `settled()` awaits it too."""
        self.state.wanted = False
        self._attempt = 0
        previous = self._pending

        async def run() -> DrainResult | None:
            # A registration in flight (POST + confirmation) must not delay the removal: cancel
            # it; whatever the router did with it shows up in the list we read next.
            await self._after(previous)
            await self._deregister(reason)
            result = await self.drain_idle() if wait_idle else None
            self._ensure_loop()  # keep us out: a lost DELETE shows up in a later list
            return result

        self._pending = asyncio.get_running_loop().create_task(run())
        return self._pending

    async def _after(self, previous: asyncio.Task[DrainResult | None] | None) -> None:
        """The removal or move before this one has finished; the registration loop stopped."""
        if previous is not None and not previous.done():
            with contextlib.suppress(asyncio.CancelledError):
                await previous
        await self._stop_loop()

    async def settled(self, timeout: float | None = None) -> DrainResult | None:
        """Await the last deregistration (and drain). Never raises; bounded."""
        task = self._pending
        if task is None:
            return None
        limit = timeout if timeout is not None else self._deregister_budget()
        try:
            return await asyncio.wait_for(asyncio.shield(task), limit)
        except TimeoutError:
            self._fail(Failure("deregister", "timeout", f"deregistration took over {limit:g}s"))
            return None
        except Exception as exc:  # a bug here must not stop a stop
            self._fail(Failure("deregister", "internal", f"{type(exc).__name__}: {exc}"))
            return None

    def status(self) -> dict[str, Any]:
        return self.state.to_status()

    def reconfigure(self, cfg: RouterConfig) -> None:
        """A reload that keeps the router and the worker URL: drain_timeout and api_key_file
        apply from the next call on."""
        self.cfg = cfg
        self._headers = self._auth_headers()

    def retarget(self, cfg: RouterConfig, sglang_url: str) -> None:
        """A reload moved this SGLang to another router (router.url) or another worker URL:
        out of the old list, confirmed as before any stop, then the same duty towards the new
        one (registered at once if the machine wants it, kept out otherwise).

        Begun on the loop's next turn: the actions the machine takes for the same reload (a
        restart's deregistration and drain, of the SGLang still running at its old URL) are
        handed to this link first, so the move waits for them."""
        asyncio.get_running_loop().call_soon(self._begin_retarget, cfg, sglang_url)

    def _begin_retarget(self, cfg: RouterConfig, sglang_url: str) -> None:
        previous = self._pending

        async def run() -> DrainResult | None:
            await self._after(previous)
            async with self._lock:
                removed = await self._remove_all("deregister")
                old = (self.cfg.url, self.cfg.worker_url)
                self._switch(cfg, sglang_url)
            self.log.info(
                "router: moved",
                old_url=old[0],
                old_worker_url=old[1],
                url=cfg.url,
                worker_url=cfg.worker_url,
                removed_from_old=removed,
            )
            self._attempt = 0
            self._ensure_loop()
            self._wake.set()
            return None

        if not self._closed:
            self._pending = asyncio.get_running_loop().create_task(run())

    def _switch(self, cfg: RouterConfig, sglang_url: str) -> None:
        assert cfg.url is not None
        wanted, errors = self.state.wanted, self.state.errors
        self._set_registered(False)
        self.cfg, self.base, self.sglang_url = cfg, cfg.url.rstrip("/"), sglang_url.rstrip("/")
        self.state = RouterState(cfg.url, cfg.worker_url, wanted=wanted, errors=errors)
        self._headers = self._auth_headers()

    async def close(self, timeout: float = 5.0) -> None:
        """Stop the background loop (after a last deregistration, if one is pending)."""
        self._closed = True
        with contextlib.suppress(Exception):
            await self.settled(timeout)
        for task in (self._loop_task, self._pending):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    # ------------------------------------------------------------------ one pass each

    async def list_workers(self) -> list[Worker] | Failure:
        got = await self._call("list", "GET", "/workers")
        if isinstance(got, Failure):
            return got
        return parse_workers(*got)

    async def register_once(self) -> bool:
        """One attempt: adopt a listed entry for our URL, else POST and wait until listed."""
        self.state.wanted = True
        async with self._lock:
            return await self._register_once()

    async def reconcile_once(self) -> bool:
        """Compare the router's list with what we want and fix it. True when they agree."""
        async with self._lock:
            if self.state.wanted:
                return await self._register_once()
            return await self._remove_all("deregister")

    async def drain_idle(self) -> DrainResult:
        """Wait until SGLang reports no running and no queued request (its /metrics, needs
        --enable-metrics), at most router.drain_timeout (`wait_idle`)."""
        result = await wait_idle(
            self.client,
            self.sglang_url,
            self.cfg.drain_timeout,
            request_timeout=self.request_timeout,
            clock=self.clock,
        )
        self.state.last_drain = {**result.to_status(), "at": self.wall()}
        if result.error:
            kind = "metrics" if result.running is None else "not_idle"
            self._fail(Failure("drain", kind, result.error))
        else:
            self.log.info("sglang drained", waited_s=round(result.waited_s, 3))
        return result

    # ------------------------------------------------------------------ internals

    def _deregister_budget(self) -> float:
        # DELETE + confirmation, per listed entry (rarely more than one), plus the drain.
        return 2 * (self.request_timeout + self.confirm_timeout) + self.cfg.drain_timeout + 1.0

    async def _stop_loop(self) -> None:
        task = self._loop_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        self._loop_task = None

    def _ensure_loop(self) -> None:
        if self._closed:
            return
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._converge())

    async def _converge(self) -> None:
        """Forever: make the router's list match `wanted`, then recheck periodically."""
        while not self._closed:
            self._wake.clear()
            try:
                ok = await self.reconcile_once()
            except Exception as exc:  # never let the loop die silently
                self._fail(Failure("list", "internal", f"{type(exc).__name__}: {exc}"))
                ok = False
            if ok:
                self._attempt = 0
                delay = self.recheck_interval
            else:
                delay = backoff(self._attempt, self.backoff_initial, self.backoff_max, self.rng)
                self._attempt += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def _register_once(self) -> bool:
        listed = await self.list_workers()
        if isinstance(listed, Failure):
            self._fail(listed)
            return False
        if not self.state.wanted:
            return False
        known = self.state.worker_id
        if known is not None and not any(w.id == known for w in listed) and self.state.registered:
            self._fail(
                Failure(
                    "list",
                    "vanished",
                    f"the router no longer lists worker id {known} (router restarted, or "
                    "removed by someone else): registering again",
                )
            )
            self._set_registered(False)
        entry = self._entry(listed)
        if entry is not None:
            self._confirmed(entry.id)
            return True
        adding = next((w for w in self._mine(listed) if w.adding), None)
        if adding is not None:  # SMG is adding it already (an earlier POST of ours)
            self.state.worker_id = adding.id
            return await self._until_listed(adding.id)
        if any(w.leaving for w in self._mine(listed)) and not await self._until_left():
            return False
        got = await self._call("register", "POST", "/workers", json={"url": self.cfg.worker_url})
        if isinstance(got, Failure):
            self._fail(got)
            return False
        added = parse_added(*got)
        if isinstance(added, Failure):
            self._fail(added)
            return False
        if isinstance(added, Known):  # SMG's 409: the list says which entry
            self.log.info("router: knows this URL already", code=added.code, answer=added.message)
            return await self._until_listed(None)
        self.state.worker_id = added
        return await self._until_listed(added)

    def _mine(self, listed: list[Worker]) -> list[Worker]:
        return [w for w in listed if same_url(w.url, self.cfg.worker_url)]

    def _entry(self, listed: list[Worker], wid: str | None = None) -> Worker | None:
        """Our registration as the router lists it: neither being added (SMG's `pending`) nor
        being removed (`draining`); the entry of `wid` (else of our last id) first."""
        live = [w for w in self._mine(listed) if not w.leaving and not w.adding]
        prefer = wid or self.state.worker_id
        return next((w for w in live if w.id == prefer), live[0] if live else None)

    async def _until_listed(self, wid: str | None) -> bool:
        """Poll the list until our entry (that of `wid` if given) is listed, at most
        confirm_timeout: the router adds a worker in the background, after its own checks."""
        found: list[str] = []

        def listed(workers: list[Worker]) -> bool:
            entry = self._entry(workers, wid)
            if entry is not None and (wid is None or entry.id == wid):
                found.append(entry.id)
            return bool(found)

        got = await self._poll(self.confirm_timeout, self.poll_interval, listed)
        if got:
            self._confirmed(found[0])
            return True
        if got is None:
            which = f"id {wid}" if wid else "already known to it"
            self._fail(
                Failure(
                    "register",
                    "not_listed",
                    f"the router accepted {self.cfg.worker_url} ({which}) but did not list it "
                    f"within {self.confirm_timeout:g}s: can the router reach router.worker_url?",
                )
            )
        return False

    async def _until_left(self) -> bool:
        """SMG keeps a removed entry listed as `draining` (5 s by default) and answers a POST
        for its URL 409 meanwhile: wait until it is gone, at most settle_timeout. A second
        DELETE would end SMG's drain at once, so none is sent."""
        url = self.cfg.worker_url
        self.log.info("router: waiting for its draining entry to go", worker_url=url)
        interval = max(self.poll_interval, SETTLE_POLL)
        got = await self._poll(
            self.settle_timeout,
            interval,
            lambda workers: not any(w.leaving for w in self._mine(workers)),
        )
        if got is None:
            self._fail(
                Failure(
                    "register",
                    "still_draining",
                    f"the router still lists {url} as draining "
                    f"{self.settle_timeout:g}s after its removal",
                )
            )
        return bool(got)

    async def _poll(
        self, budget: float, interval: float, done: Callable[[list[Worker]], bool]
    ) -> bool | None:
        """Read the list until `done(list)`, at most `budget` seconds, while the machine wants
        us registered: True when done, False when a read failed or we are no longer wanted,
        None at the budget."""
        deadline = self.clock() + budget
        while self.clock() < deadline:
            if not self.state.wanted:
                return False
            listed = await self.list_workers()
            if isinstance(listed, Failure):
                self._fail(listed)
                return False
            if done(listed):
                return True
            await asyncio.sleep(interval)
        return None

    async def _deregister(self, reason: str) -> bool:
        async with self._lock:
            ok = await self._remove_all("deregister")
        if ok:
            self.log.info("router: deregistered", reason=reason, worker_url=self.cfg.worker_url)
        return ok

    async def _remove_all(self, op: str) -> bool:
        """DELETE every entry for our URL (and our id), then confirm through the list."""
        listed = await self.list_workers()
        if isinstance(listed, Failure):
            self._fail(Failure(op, listed.kind, listed.message))
            return False
        ids = {w.id for w in listed if same_url(w.url, self.cfg.worker_url) and not w.leaving}
        if not ids:
            self._set_registered(False)
            return True
        if not self.state.registered:
            # Not ours to be listed now: an addition the router finished after our removal, a
            # router started with --worker-urls, or another client. Out it goes.
            self.log.warning(
                "router lists this SGLang while it must not: removing it",
                worker_url=self.cfg.worker_url,
                worker_ids=sorted(ids),
            )
        for wid in ids:
            got = await self._call(op, "DELETE", f"/workers/{urllib.parse.quote(wid, safe='')}")
            if isinstance(got, Failure):
                self._fail(got)
                return False
            status, body, _ = got
            if status not in (200, 202, 204, 404):  # 404: gone already
                self._fail(
                    Failure(
                        op,
                        "http_status",
                        f"DELETE /workers/{wid} answered HTTP {status}{_snip(body)}",
                    )
                )
                return False
        deadline = self.clock() + self.confirm_timeout
        while True:
            listed = await self.list_workers()
            if isinstance(listed, Failure):
                self._fail(Failure(op, listed.kind, listed.message))
                return False
            left = [w.id for w in listed if same_url(w.url, self.cfg.worker_url) and not w.leaving]
            if not left:
                self._set_registered(False)
                self.state.worker_id = None
                self._ok()
                return True
            if self.clock() >= deadline:
                self._fail(
                    Failure(
                        op,
                        "still_listed",
                        f"the router still lists {self.cfg.worker_url} ({', '.join(left)}) "
                        f"{self.confirm_timeout:g}s after DELETE",
                    )
                )
                return False
            await asyncio.sleep(self.poll_interval)

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
            token = admin_token.read_secret(path, "router.api_key_file")
        except admin_token.TokenFileError as exc:
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
