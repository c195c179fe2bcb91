"""A reload that changes the `router:` section (`router.relink`), against two real routers with
a stand-in SGLang: the link leaves the old router's list (confirmed) and joins the new one, a
drain_timeout change just applies, router.url set or removed adds or closes the link, and a
move that comes with a restart waits for the restart's deregistration and drain."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from supervisor import config
from supervisor.config import Config
from supervisor.daemon import reload
from supervisor.metrics import Metrics
from supervisor.router import RouterLink, close_link, link_for, relink
from testkit.daemon import BIN, running
from testkit.fleet import registered, replica_config, worker_url
from testkit.router import Recorder, RouterProcess
from testkit.standin import Launcher, Standin
from testkit.wait import wait_until_async

# The links a reload removed, kept until closed (the daemon's RouterSlot.closing).
CLOSING: set[asyncio.Task[None]] = set()


@pytest.fixture(scope="module")
def other_router() -> Iterator[RouterProcess]:
    proc = RouterProcess(["--worker-startup-timeout-secs", "10"]).start()
    yield proc
    proc.cleanup()


def cfg_for(replica: Standin, router_url: str | None, drain_timeout: str = "5s") -> Config:
    text = f"sglang:\n  model_path: /m\n  host: 127.0.0.1\n  port: {replica.port}\n"
    if router_url is not None:
        text += f"router:\n  url: {router_url}\n  drain_timeout: {drain_timeout}\n"
    return config.parse(text, "t.yaml")


def fresh_link(cfg: Config, log: Recorder, metrics: Metrics) -> RouterLink:
    link = link_for(cfg, log, metrics)
    assert link is not None
    link.recheck_interval = 0.2
    return link


async def test_a_new_router_url_moves_the_registration(
    router: RouterProcess, other_router: RouterProcess, launch: Launcher
) -> None:
    replica = launch()
    url = replica.url("")
    log, metrics = Recorder(), Metrics(CollectorRegistry())
    old = cfg_for(replica, router.url)
    link = fresh_link(old, log, metrics)
    try:
        link.want_registered()
        await wait_until_async(
            lambda: link.state.registered, 15.0, "registered with the first router"
        )
        first_id = link.status()["worker_id"]
        assert url in router.urls()

        new = cfg_for(replica, other_router.url)
        assert reload.router_only(old, new) and reload.judge(old, new).value == "unchanged"
        assert relink(link, new, log, metrics, ready=True, closing=CLOSING) is link
        await wait_until_async(
            lambda: url in other_router.urls(), 15.0, "registered with the second router"
        )
        await wait_until_async(lambda: link.state.registered, 15.0, "confirmed")
        assert url not in router.urls()
        status = link.status()
        assert status["url"] == other_router.url and status["worker_id"] != first_id
        moved = [kw for e, kw in log.lines if e == "router: moved"]
        assert moved == [
            {
                "old_url": router.url,
                "old_worker_url": url,
                "url": other_router.url,
                "worker_url": url,
                "removed_from_old": True,
            }
        ]
        # And it keeps the duty towards the new router only: the old one stays empty.
        await asyncio.sleep(0.5)
        assert url not in router.urls() and url in other_router.urls()
    finally:
        await close_link(link)


async def test_a_move_that_comes_with_a_restart_waits_for_its_drain(
    router: RouterProcess, other_router: RouterProcess, launch: Launcher
) -> None:
    """As the daemon does it: relink, then (same turn of the loop) the restart's
    deregistration with wait_idle. The deregistration and drain happen at the old router and
    the running SGLang first; then the link moves and keeps SGLang out of the new router
    until the machine says ready again."""
    replica = launch()
    url = replica.url("")
    log, metrics = Recorder(), Metrics(CollectorRegistry())
    link = fresh_link(cfg_for(replica, router.url), log, metrics)
    try:
        link.want_registered()
        await wait_until_async(lambda: link.state.registered, 15.0, "registered")
        new = cfg_for(replica, other_router.url, drain_timeout="7s")
        assert relink(link, new, log, metrics, ready=False, closing=CLOSING) is link
        link.begin_deregister("reload", wait_idle=True)
        result = await link.settled()
        assert result is not None and result.idle, result
        await wait_until_async(lambda: "router: moved" in [e for e, _ in log.lines], 15.0, "moved")
        events = [e for e, _ in log.lines if e in ("router: deregistered", "router: moved")]
        assert events[:2] == ["router: deregistered", "router: moved"], log.lines
        assert link.cfg.url == other_router.url and link.cfg.drain_timeout == 7.0
        assert url not in router.urls() and url not in other_router.urls()
        await asyncio.sleep(0.5)  # the keep-out loop runs against the new router
        assert url not in other_router.urls() and not link.state.registered

        link.want_registered()  # ready again after the restart
        await wait_until_async(
            lambda: url in other_router.urls(), 15.0, "registered with the new router"
        )
        assert url not in router.urls()
    finally:
        await close_link(link)


async def test_drain_timeout_alone_applies_without_a_call(
    router: RouterProcess, launch: Launcher
) -> None:
    replica = launch()
    log, metrics = Recorder(), Metrics(CollectorRegistry())
    old = cfg_for(replica, router.url)
    link = fresh_link(old, log, metrics)
    try:
        link.want_registered()
        await wait_until_async(lambda: link.state.registered, 15.0, "registered")
        wid = link.status()["worker_id"]
        new = cfg_for(replica, router.url, drain_timeout="42s")
        assert reload.router_only(old, new)
        assert relink(link, new, log, metrics, ready=True, closing=CLOSING) is link
        assert link.cfg.drain_timeout == 42.0
        await asyncio.sleep(0.3)
        assert link.state.registered and link.status()["worker_id"] == wid
        assert not [e for e, _ in log.lines if e == "router: moved"]
    finally:
        await close_link(link)


async def test_router_url_set_then_removed(router: RouterProcess, launch: Launcher) -> None:
    replica = launch()
    url = replica.url("")
    log, metrics = Recorder(), Metrics(CollectorRegistry())
    without = cfg_for(replica, None)
    assert relink(None, without, log, metrics, ready=True, closing=CLOSING) is None

    with_router = cfg_for(replica, router.url)
    assert reload.router_only(without, with_router)
    link = relink(None, with_router, log, metrics, ready=True, closing=CLOSING)
    assert link is not None
    await wait_until_async(
        lambda: link.state.registered, 15.0, "registered at once (the machine is ready)"
    )
    assert url in router.urls()

    assert relink(link, without, log, metrics, ready=True, closing=CLOSING) is None
    assert len(CLOSING) == 1  # the caller keeps the closing task
    await wait_until_async(lambda: url not in router.urls(), 15.0, "out of the router")
    await wait_until_async(lambda: link.client.is_closed, 15.0, "the removed link is closed")
    await wait_until_async(lambda: not CLOSING, 5.0, "the closing task let go once done")

    # Set again while not ready: kept out until the machine says ready.
    again = relink(None, with_router, log, metrics, ready=False, closing=CLOSING)
    assert again is not None
    try:
        await again.settled()
        await asyncio.sleep(0.3)
        assert url not in router.urls() and not again.state.registered
    finally:
        await close_link(again)


def test_a_router_change_beside_another_change_restarts() -> None:
    base = "sglang:\n  model_path: /m\n  port: 30001\n"
    old = config.parse(base + "router:\n  url: http://127.0.0.1:1\n", "t.yaml")
    new = config.parse(
        base + "  args: {mem-fraction-static: 0.8}\nrouter:\n  url: http://127.0.0.1:2\n",
        "t.yaml",
    )
    assert not reload.router_only(old, new)
    assert reload.judge(old, new).value == "changed"
    assert not reload.router_only(old, old)


@pytest.mark.slow
async def test_the_daemon_moves_between_routers_on_sighup_without_a_restart(
    router: RouterProcess, other_router: RouterProcess, tmp_path: Path
) -> None:
    """The real `kimi-serve run` (stand-in SGLang): a reload that only changes router.url
    leaves the old router (confirmed), joins the new one, and SGLang keeps running; a reload
    that removes router.url takes it out and /status.router says no router (url null)."""
    cfg = replica_config(tmp_path, router.url)
    url = worker_url(cfg)
    with running(tmp_path, cfg) as d:
        await asyncio.to_thread(d.wait_state, "ready", 30)
        await wait_until_async(lambda: registered(d), 15.0, "registered with the first router")
        pid = await asyncio.to_thread(d.sglang_pid)

        cfg["router"]["url"] = other_router.url
        cfg["router"]["drain_timeout"] = "7s"
        d.config_path.write_text(yaml.safe_dump(cfg))
        d.signal(signal.SIGHUP)
        moved = await asyncio.to_thread(
            d.wait_for, lambda e: e.get("event") == "router: moved", 20, "router: moved"
        )
        assert moved["url"] == other_router.url and moved["removed_from_old"] is True
        await wait_until_async(
            lambda: url in other_router.urls(), 15.0, "listed by the second router"
        )
        await wait_until_async(lambda: registered(d), 15.0, "registered")
        status = await asyncio.to_thread(d.status)
        assert status["router"]["url"] == other_router.url
        assert url not in router.urls()
        assert await asyncio.to_thread(d.sglang_pid) == pid, "SGLang was restarted"
        assert "restarting" not in d.states()
        shown = subprocess.run(
            [str(BIN), "status", "--config", str(d.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert f"Router: {other_router.url} as {url}, registered (worker " in shown.stdout, shown

        del cfg["router"]
        d.config_path.write_text(yaml.safe_dump(cfg))
        d.signal(signal.SIGHUP)
        await wait_until_async(
            lambda: url not in other_router.urls(), 15.0, "out of the second router"
        )
        await wait_until_async(
            lambda: d.status()["router"]["url"] is None, 15.0, "no router in /status"
        )
        assert d.status()["router"]["registered"] is False
        assert await asyncio.to_thread(d.sglang_pid) == pid
        assert d.states()[-1] == "ready"
