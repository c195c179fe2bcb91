"""The daemon's side of the router in front of a fleet: the link made, moved or closed on a
reload (`relink`), the machine's router actions carried out, and the admin `POST /drain` /
`/undrain` answers. The link itself is `router.link.RouterLink` (docs/fleet.md); the router's
answers are parsed in `router_api`, the drain's wait for SGLang is `drain_wait`. Every name
those modules give is importable from here too."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from supervisor import admin
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
from supervisor.router.link import MAX_ANSWER_BYTES as MAX_ANSWER_BYTES
from supervisor.router.link import Log as Log
from supervisor.router.link import RouterLink as RouterLink
from supervisor.router.link import RouterMetrics as RouterMetrics
from supervisor.router.link import RouterState as RouterState
from supervisor.router.link import unlinked_status as unlinked_status
from supervisor.sglang.drain_wait import DrainResult as DrainResult
from supervisor.sglang.drain_wait import parse_load as parse_load
from supervisor.sglang.drain_wait import sglang_load as sglang_load
from supervisor.sglang.drain_wait import wait_idle as wait_idle
from supervisor.sglang.drain_wait import waited_for as waited_for
from supervisor.sglang.probe import server_url

HttpFactory = Callable[[], httpx.AsyncClient]

# ---------------------------------------------------------------------- admin /drain /undrain


@dataclass(frozen=True)
class DrainAnswer:
    status: int  # HTTP status for the admin endpoint: 200 done, 409 refused
    body: dict[str, Any]


NO_ROUTER = "router.url is not set: nothing to deregister; /readyz answers 503 while draining"

Idle = Callable[[], Awaitable[DrainResult]]


async def answer_drain(
    link: RouterLink | None,
    request: Callable[[], str | None],
    idle: Idle | None = None,
    waiting_for: str | None = None,
) -> DrainAnswer:
    """POST /drain. `request()` is the daemon's: it returns why the machine refuses
    (`Machine.drain_refusal()`), or feeds it DrainRequested and returns None; the machine's
    RouterDeregister(wait_idle=True) then starts the work, which this awaits (bounded).

    Without a router there is nothing to deregister, but the wait for SGLang's running and
    queued requests is the same (`idle()`: `wait_idle`, bounded by router.drain_timeout), so
    the answer still means "nothing is in flight, or the budget ran out". `waiting_for` says
    what was waited for (`waited_for()`)."""
    refused = request()
    if refused:
        return DrainAnswer(409, {"drained": False, "error": refused})
    if link is None:
        body: dict[str, Any] = {"drained": True, "router": None, "note": NO_ROUTER}
        if idle is not None:
            body["drain"] = (await idle()).to_status()
    else:
        result = await link.settled()
        body = {"drained": True, "router": link.status()}
        if result is not None:
            body["drain"] = result.to_status()
    if waiting_for is not None:
        body["waited_for"] = waiting_for
    return DrainAnswer(200, body)


async def answer_undrain(link: RouterLink | None, request: Callable[[], str | None]) -> DrainAnswer:
    """POST /undrain: back to `ready`; the machine's RouterRegister registers again (in the
    background, retried like any registration), so this answers at once."""
    refused = request()
    if refused:
        return DrainAnswer(409, {"undrained": False, "error": refused})
    return DrainAnswer(
        200, {"undrained": True, "router": link.status() if link is not None else None}
    )


# ---------------------------------------------------------------------- the daemon's link


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


class HttpHolder(Protocol):
    """The part of the daemon's effects the drain wait uses: its HTTP client."""

    @property
    def http(self) -> httpx.AsyncClient: ...


class DrainHost(Protocol):
    """What the admin drain needs of the daemon: its current link (a reload may add, move or
    remove it), the machine's verdict on a drain / undrain request, and, for the wait without
    a router, the configuration (SGLang's address, router.drain_timeout) and the HTTP client."""

    @property
    def router(self) -> RouterLink | None: ...
    @property
    def cfg(self) -> Config: ...
    @property
    def fx(self) -> HttpHolder: ...
    @property
    def log(self) -> Log: ...
    def request_drain(self) -> str | None: ...
    def request_undrain(self) -> str | None: ...


def drain_ops(host: DrainHost) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The admin endpoint's on_drain / on_undrain: 409 (admin.Refused) when the machine
    refuses, else the answer once the router work and the wait are done (drain) or started
    (undrain)."""

    def sglang() -> str:
        return server_url(host.cfg.sglang.host, host.cfg.sglang.port)

    async def idle() -> DrainResult:
        result = await wait_idle(host.fx.http, sglang(), host.cfg.router.drain_timeout)
        if result.error:
            host.log.warning("drain: sglang not idle", error=result.error)
        else:
            host.log.info("sglang drained", waited_s=round(result.waited_s, 3))
        return result

    async def drain() -> dict[str, Any]:
        link = host.router
        budget = host.cfg.router.drain_timeout
        url = link.sglang_url if link is not None else sglang()
        got = await answer_drain(link, host.request_drain, idle, waited_for(url, budget))
        return checked(got)

    async def undrain() -> dict[str, Any]:
        return checked(await answer_undrain(host.router, host.request_undrain))

    def checked(got: DrainAnswer) -> dict[str, Any]:
        if got.status != 200:
            raise admin.Refused(str(got.body.get("error")))
        return got.body

    return drain, undrain
