"""Registration with the router: adopt a listed entry for our URL, else POST and wait until the
router lists it; an entry the router is still adding, or still draining, is waited for
(sglang-router and SMG differ here: link.py's docstring says how)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from supervisor.router.api import Failure, Known, Worker, parse_added, same_url
from supervisor.router.calls import RouterCalls

SETTLE_POLL = 0.25  # the list polled while SMG drains our old entry: it lasts seconds


class Registration(RouterCalls):
    """One registration attempt and the waits it is made of."""

    async def register_once(self) -> bool:
        """One attempt: adopt a listed entry for our URL, else POST and wait until listed."""
        self.state.wanted = True
        async with self._lock:
            return await self._register_once()

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
