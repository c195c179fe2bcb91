"""The machine's router decisions carried out by RouterLink against the real router, the way
the daemon's action loop does it: RouterRegister / RouterDeregister start the link's work, and
a StopChild waits for `settled()` first. A stand-in plays SGLang."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import httpx

from supervisor.config import RouterConfig
from supervisor.core import machine as core
from supervisor.router import RouterLink, answer_drain, answer_undrain
from testkit.machine import CFG, ok_result
from testkit.router import GENERATE, Recorder, RouterProcess, served
from testkit.standin import Launcher
from testkit.wait import wait_until_async


class Loop:
    """The part of the daemon's loop that concerns the router."""

    def __init__(self, machine: core.Machine, link: RouterLink, router: RouterProcess, url: str):
        self.m, self.link, self.router, self.url = machine, link, router, url
        self.listed_at_stop: list[bool] = []
        self.stops: list[asyncio.Task[None]] = []

    def dispatch(self, event: core.Event) -> None:
        for action in self.m.handle(event, time.monotonic()):
            self.do(action)

    def do(self, action: core.Action) -> None:
        match action:
            case core.RouterRegister():
                self.link.want_registered()
            case core.RouterDeregister():
                self.link.begin_deregister(action.reason, action.wait_idle)
            case core.StopChild():

                async def stop() -> None:
                    await self.link.settled()  # before any signal reaches SGLang
                    self.listed_at_stop.append(self.url in self.router.urls())

                self.stops.append(asyncio.ensure_future(stop()))
            case _:
                pass


async def test_ready_drain_undrain_restart(router: RouterProcess, launch: Launcher) -> None:
    replica = launch()
    url = replica.url("")
    cfg = replace(CFG, router=RouterConfig(url=router.url, worker_url=url, drain_timeout=5))
    async with httpx.AsyncClient(trust_env=False) as client:
        link = RouterLink(cfg.router, client, Recorder(), recheck_interval=0.2, poll_interval=0.05)
        loop = Loop(core.Machine(cfg, time.monotonic()), link, router, url)
        try:
            for event in (
                core.Start(),
                core.HostReady(),
                core.Launched(1, replica.proc.pid),
                core.PortOpen(1),
            ):
                loop.dispatch(event)
                assert url not in router.urls(), "registered before the decode probe"
            loop.dispatch(core.ProbeDone(1, core.ProbeKind.READINESS, ok_result()))
            assert loop.m.state is core.State.READY
            await wait_until_async(lambda: url in router.urls(), 15.0, "registered")

            def drain() -> str | None:
                refused = loop.m.drain_refusal()
                if refused is None:
                    loop.dispatch(core.DrainRequested())
                return refused

            answer = await answer_drain(link, drain)
            assert answer.status == 200 and answer.body["drain"]["idle"] is True
            assert loop.m.state is core.State.DRAINING and url not in router.urls()
            r = await client.post(router.url + "/generate", json=GENERATE)
            assert r.status_code == 503  # nothing else behind this router

            def undrain() -> tuple[str | None, str | None]:
                needless = loop.m.undrain_needless()
                if needless is not None:
                    return None, needless
                refused = loop.m.undrain_refusal()
                if refused is None:
                    loop.dispatch(core.UndrainRequested())
                return refused, None

            done = await answer_undrain(link, undrain)
            assert done.status == 200 and done.body["undrained"] is True
            # Not draining now: nothing to undo, said so, not refused.
            again = await answer_undrain(link, undrain)
            assert again.status == 200 and again.body["undrained"] is False
            assert str(again.body["already"]).startswith("not draining: ready")
            await wait_until_async(lambda: url in router.urls(), 15.0, "registered again")
            before = served(replica)
            r = await client.post(router.url + "/generate", json=GENERATE)
            assert r.status_code == 200
            await wait_until_async(
                lambda: served(replica) == before + 1, 15.0, "the replica to log it"
            )

            loop.dispatch(core.RestartRequested(core.Reason.MANUAL))
            await asyncio.gather(*loop.stops)
            assert loop.listed_at_stop == [False], "SGLang stopped while still listed"
            assert (await answer_drain(link, drain)).status == 409  # restarting: not serving
        finally:
            await link.close()
