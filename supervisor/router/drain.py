"""The admin endpoint's `POST /drain` and `/undrain`: the machine asked, the router's work (or,
without router.url, the wait for SGLang alone) awaited, the answer built.

The one module of the room that knows the admin endpoint (`admin.Refused` is how a handler
answers 409).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from supervisor import admin
from supervisor.config import Config
from supervisor.router.link import RouterLink
from supervisor.router.state import Log
from supervisor.sglang.drain_wait import DrainResult, wait_idle, waited_for
from supervisor.sglang.probe import server_url


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


async def answer_undrain(
    link: RouterLink | None, request: Callable[[], tuple[str | None, str | None]]
) -> DrainAnswer:
    """POST /undrain: back to `ready`; the machine's RouterRegister registers again (in the
    background, retried like any registration), so this answers at once. A host serving and
    not draining has nothing to undo: 200 with `undrained: false` and `already` saying so (an
    undrain is idempotent, as a script retrying it expects)."""
    refused, already = request()
    if refused:
        return DrainAnswer(409, {"undrained": False, "error": refused})
    router = link.status() if link is not None else None
    if already:
        return DrainAnswer(200, {"undrained": False, "already": already, "router": router})
    return DrainAnswer(200, {"undrained": True, "router": router})


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
    def request_undrain(self) -> tuple[str | None, str | None]: ...


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
