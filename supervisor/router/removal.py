"""Removal from the router: DELETE every entry for our URL, confirmed through the list, and the
drain's wait for SGLang to be idle afterwards."""

from __future__ import annotations

import asyncio
import urllib.parse

from supervisor.router.api import Failure, _snip, same_url
from supervisor.router.calls import RouterCalls
from supervisor.sglang.drain_wait import DrainResult, wait_idle


class Removal(RouterCalls):
    """Out of the router's list, confirmed, within a bounded time."""

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

    def _deregister_budget(self) -> float:
        # DELETE + confirmation, per listed entry (rarely more than one), plus the drain.
        return 2 * (self.request_timeout + self.confirm_timeout) + self.cfg.drain_timeout + 1.0

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
