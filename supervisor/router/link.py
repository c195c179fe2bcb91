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
  removed, registers again only once it is gone (`Registration._until_left`, at most
  settle_timeout), and never DELETEs it again: SMG would end the drain of the old requests at
  once.
- With no worker listed SMG answers 404 `model_not_found`; with only a draining one 503
  `no_available_workers`.

Nothing here raises into the caller: every failure is classified, logged once per change,
counted (`kimi_serve_router_errors_total{op}`) and shown in `/status.router.last_error`.

The link is built in layers: `calls.RouterCalls` (its settings and state, every call to the
router and its bookkeeping), `registration.Registration` and `removal.Removal` on it, and
`RouterLink` here: what the daemon calls, and the one background loop.
"""

from __future__ import annotations

import asyncio
import contextlib

from supervisor.config import RouterConfig
from supervisor.router.api import Failure, backoff
from supervisor.router.registration import Registration
from supervisor.router.removal import Removal
from supervisor.router.state import RouterState
from supervisor.sglang.drain_wait import DrainResult


class RouterLink(Registration, Removal):
    """Keeps the router's worker list in line with what the machine wants.

    `want_registered()` / `begin_deregister()` are called from the daemon's (synchronous)
    action loop and return at once; the work runs in one background task per link, so calls
    never interleave. `settled()` is what a stop awaits: it returns when the last requested
    deregistration (and drain) is done or has given up, always within a bounded time.
    """

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

    # ------------------------------------------------------------------ the loop

    async def reconcile_once(self) -> bool:
        """Compare the router's list with what we want and fix it. True when they agree."""
        async with self._lock:
            if self.state.wanted:
                return await self._register_once()
            return await self._remove_all("deregister")

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
