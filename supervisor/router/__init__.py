"""The daemon's side of the router in front of a fleet: the link made, moved or closed on a
reload (`relink`), the machine's router actions carried out (`carry_out`). The link itself is
`router.link.RouterLink` (docs/fleet.md), built on `calls`, `registration` and `removal`; the
router's answers are parsed in `router.api`, the admin `POST /drain` / `/undrain` answered in
`router.drain`, the drain's wait for SGLang is `sglang.drain_wait`. Every name those modules give
is importable from here too."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import httpx

from supervisor.config import Config
from supervisor.core.machine import RouterDeregister, RouterRegister
from supervisor.router.api import Failure as Failure
from supervisor.router.api import Known as Known
from supervisor.router.api import Worker as Worker
from supervisor.router.api import backoff as backoff
from supervisor.router.api import key_in_clear as key_in_clear
from supervisor.router.api import parse_added as parse_added
from supervisor.router.api import parse_workers as parse_workers
from supervisor.router.api import same_url as same_url
from supervisor.router.calls import MAX_ANSWER_BYTES as MAX_ANSWER_BYTES
from supervisor.router.drain import NO_ROUTER as NO_ROUTER
from supervisor.router.drain import DrainAnswer as DrainAnswer
from supervisor.router.drain import DrainHost as DrainHost
from supervisor.router.drain import HttpHolder as HttpHolder
from supervisor.router.drain import answer_drain as answer_drain
from supervisor.router.drain import answer_undrain as answer_undrain
from supervisor.router.drain import drain_ops as drain_ops
from supervisor.router.link import RouterLink as RouterLink
from supervisor.router.state import Log as Log
from supervisor.router.state import RouterMetrics as RouterMetrics
from supervisor.router.state import RouterState as RouterState
from supervisor.router.state import unlinked_status as unlinked_status
from supervisor.sglang.drain_wait import DrainResult as DrainResult
from supervisor.sglang.drain_wait import parse_load as parse_load
from supervisor.sglang.drain_wait import sglang_load as sglang_load
from supervisor.sglang.drain_wait import wait_idle as wait_idle
from supervisor.sglang.drain_wait import waited_for as waited_for
from supervisor.sglang.probe import server_url

HttpFactory = Callable[[], httpx.AsyncClient]


def link_for(
    cfg: Config, log: Log, metrics: RouterMetrics, http: HttpFactory | None = None
) -> RouterLink | None:
    """The daemon's link, or None without router.url. Its own HTTP client (`http()`, the
    daemon's `Effects.router_http`): a router that hangs must not hold connections the probes
    need."""
    if cfg.router.url is None:
        return None
    client = http() if http is not None else httpx.AsyncClient(trust_env=False)
    return RouterLink(cfg.router, client, log, metrics, sglang_url=_sglang_url(cfg))


def _sglang_url(cfg: Config) -> str:
    # One builder for SGLang's URL: an IPv6 host is bracketed and a wildcard bind is reached
    # on loopback ("::" once gave http://:::30000/metrics for the drain wait).
    return server_url(cfg.sglang.host, cfg.sglang.port)


def relink(
    link: RouterLink | None,
    cfg: Config,
    log: Log,
    metrics: RouterMetrics,
    ready: bool,
    http: HttpFactory | None = None,
    *,
    closing: set[asyncio.Task[None]],
) -> RouterLink | None:
    """The daemon's link after a reload took `cfg`. `ready`: the machine is `ready` and stays
    so (no restart follows), so a newly configured router gets this SGLang at once.

    - the same router and worker URL: the link is kept; drain_timeout and api_key_file apply;
    - another router.url or worker_url: the same link moves (`RouterLink.retarget`);
    - router.url set where it was null: a new link; registered now if `ready`, else kept out
      until the machine says ready;
    - router.url removed: out of the old router (confirmed, bounded), then the link is closed
      by a task the caller keeps in `closing` until it is done.
    """
    if cfg.router.url is None:
        if link is not None:
            link.begin_deregister("reload: router.url removed")
            closing.add(task := asyncio.get_running_loop().create_task(close_link(link)))
            task.add_done_callback(closing.discard)
        return None
    if link is None:
        fresh = link_for(cfg, log, metrics, http)
        assert fresh is not None
        if ready and cfg.group.role != "follower":
            fresh.want_registered()
        else:
            fresh.begin_deregister("reload")
        return fresh
    sglang_url = _sglang_url(cfg)
    same = (
        same_url(link.cfg.url or "", cfg.router.url)
        and same_url(link.cfg.worker_url, cfg.router.worker_url)
        and same_url(link.sglang_url, sglang_url)
    )
    if same:
        link.reconfigure(cfg.router)
    else:
        link.retarget(cfg.router, sglang_url)
    return link


def carry_out(link: RouterLink | None, action: RouterRegister | RouterDeregister) -> None:
    """The machine's router actions (none without router.url); both return at once."""
    if link is None:
        return
    if isinstance(action, RouterRegister):
        link.want_registered()
    else:
        link.begin_deregister(action.reason, action.wait_idle)


async def close_link(link: RouterLink | None) -> None:
    """At the daemon's teardown: a last pending deregistration (bounded), then the client."""
    if link is None:
        return
    with contextlib.suppress(Exception):
        await link.close()
    with contextlib.suppress(Exception):
        await link.client.aclose()
