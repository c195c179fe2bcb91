"""The daemon's router link, where every part that uses it reads it (docs/fleet.md).

A reload may add, move or remove the link (`router.relink`); the parts that send to it read it
here, so a reload replaces it in one place. `current` is what /status shows and what the
machine's router actions go to; `for_stop` is what a stop waits on: a link a reload removed still
deregisters before the stop that may follow it.
"""

from __future__ import annotations

import asyncio

from supervisor import router
from supervisor.config import Config
from supervisor.router import HttpFactory, Log, RouterLink, RouterMetrics


class RouterSlot:
    def __init__(
        self,
        link: RouterLink | None = None,
        *,
        log: Log | None = None,
        metrics: RouterMetrics | None = None,
        http: HttpFactory | None = None,
    ) -> None:
        self.log = log
        self.metrics = metrics
        self.http = http
        self.current = self.for_stop = link
        self.closing: set[asyncio.Task[None]] = set()  # links a reload removed, being closed

    @classmethod
    def made(cls, cfg: Config, log: Log, metrics: RouterMetrics, http: HttpFactory) -> RouterSlot:
        """The link `router.url` asks for (none without it), and what a reload needs to move it."""
        link = router.link_for(cfg, log, metrics, http)
        return cls(link, log=log, metrics=metrics, http=http)

    def relink(self, cfg: Config, ready: bool) -> None:
        """A reload took `cfg`; `ready`: the machine is `ready` and stays so (router.relink)."""
        assert self.log is not None and self.metrics is not None
        self.current = router.relink(
            self.current, cfg, self.log, self.metrics, ready, self.http, closing=self.closing
        )
        self.for_stop = self.current or self.for_stop
