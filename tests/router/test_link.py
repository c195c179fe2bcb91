"""RouterLink against the real sglang-router on loopback, with stand-in SGLang replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from supervisor.metrics import Metrics
from testkit.router import GENERATE, RouterProcess, free_port, make_link, served
from testkit.standin import Launcher
from testkit.wait import wait_until_async


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    assert value is not None, name
    return value


async def test_register_routes_traffic_then_deregister_removes_it(
    router: RouterProcess, launch: Launcher, client: httpx.AsyncClient
) -> None:
    replica = launch()
    url = replica.url("")
    link, _log, metrics = make_link(client, router.url, url)
    try:
        link.want_registered()
        await wait_until_async(lambda: link.state.registered, 15.0, "registered")
        assert url in router.urls()
        wid = link.status()["worker_id"]
        assert wid in [w["id"] for w in router.workers()]
        assert sample(metrics, "kimi_serve_router_registered") == 1

        before = served(replica)
        for _ in range(5):
            r = await client.post(router.url + "/generate", json=GENERATE, timeout=10)
            assert r.status_code == 200, r.text
        await wait_until_async(
            lambda: served(replica) == before + 5, 15.0, "the replica to log 5 requests"
        )

        task = link.begin_deregister("test", wait_idle=True)
        result = await link.settled()
        assert task.done() and result is not None and result.idle
        assert url not in router.urls()
        status = link.status()
        assert status["registered"] is False and status["worker_id"] is None
        assert status["last_error"] is None, status
        assert sample(metrics, "kimi_serve_router_registered") == 0
        # Nothing routes to it any more: the router has no worker left.
        r = await client.post(router.url + "/generate", json=GENERATE, timeout=10)
        assert r.status_code == 503
        assert served(replica) == before + 5
        # And it stays out: the background loop keeps checking while we are unregistered.
        await asyncio.sleep(0.5)
        assert url not in router.urls()
    finally:
        await link.close()


async def test_two_replicas_share_traffic_and_a_deregistered_one_gets_none(
    router: RouterProcess, launch: Launcher, client: httpx.AsyncClient
) -> None:
    a, b = launch(), launch()
    la, _, _ = make_link(client, router.url, a.url(""))
    lb, _, _ = make_link(client, router.url, b.url(""))
    try:
        la.want_registered()
        lb.want_registered()
        await wait_until_async(
            lambda: la.state.registered and lb.state.registered, 15.0, "both registered"
        )
        await lb.begin_deregister("restart")
        before_a, before_b = served(a), served(b)
        for _ in range(10):
            r = await client.post(router.url + "/generate", json=GENERATE, timeout=10)
            assert r.status_code == 200
        await wait_until_async(lambda: served(a) == before_a + 10, 15.0, "a served all 10")
        assert served(b) == before_b
    finally:
        for link in (la, lb):
            link.begin_deregister("cleanup")
            await link.close()


async def test_vanished_id_is_registered_again(
    router: RouterProcess, launch: Launcher, client: httpx.AsyncClient
) -> None:
    replica = launch()
    link, log, metrics = make_link(client, router.url, replica.url(""))
    try:
        link.want_registered()
        await wait_until_async(lambda: link.state.registered, 15.0, "registered")
        old = link.state.worker_id
        # Someone else removes it behind our back.
        r = await client.delete(f"{router.url}/workers/{old}")
        assert r.status_code == 202
        await wait_until_async(
            lambda: link.state.registered and link.state.worker_id not in (None, old),
            15.0,
            "a new id",
        )
        assert any("no longer lists worker id" in e for e in log.errors()), log.lines
        assert link.state.worker_id in [w["id"] for w in router.workers()]
        assert sample(metrics, "kimi_serve_router_errors_total", op="list") >= 1
    finally:
        await link.begin_deregister("cleanup")
        await link.close()


async def test_router_down_then_up_registers_again(
    launch: Launcher, client: httpx.AsyncClient
) -> None:
    own = RouterProcess().start()
    replica = launch()
    link, _log, metrics = make_link(client, own.url, replica.url(""))
    try:
        link.want_registered()
        await wait_until_async(lambda: link.state.registered, 15.0, "registered")
        old = link.state.worker_id
        own.kill()
        await wait_until_async(
            lambda: link.state.last_error is not None, 15.0, "the failure noticed"
        )
        assert "cannot connect" in (link.state.last_error or ""), link.state.last_error
        # Supervision is not held up: a deregistration against a dead router ends, bounded.
        began = time.monotonic()
        own.start()  # same port; it has forgotten every worker
        await wait_until_async(
            lambda: link.state.registered and replica.url("") in own.urls(),
            15.0,
            "registered with the restarted router",
        )
        assert link.state.worker_id != old
        assert time.monotonic() - began < 10
        assert sample(metrics, "kimi_serve_router_registered") == 1
    finally:
        await link.close()
        own.cleanup()


async def test_unreachable_router_never_raises_and_is_bounded(
    client: httpx.AsyncClient,
) -> None:
    link, log, metrics = make_link(
        client, f"http://127.0.0.1:{free_port()}", "http://127.0.0.1:1", request_timeout=0.5
    )
    try:
        assert await link.register_once() is False
        assert "cannot connect" in (link.state.last_error or "")
        link.want_registered()
        began = time.monotonic()
        link.begin_deregister("stop")
        assert await link.settled() is None
        assert time.monotonic() - began < 3
        assert link.state.registered is False
        assert "deregister: " in (link.state.last_error or "")
        assert sample(metrics, "kimi_serve_router_errors_total", op="deregister") >= 1
        # One log line per distinct failure, not one per retry.
        errors = log.errors()
        assert len(errors) == len(set(errors)) or len(errors) <= 3
    finally:
        await link.close()


async def test_accepted_but_never_listed_is_a_clear_error(
    router: RouterProcess, client: httpx.AsyncClient
) -> None:
    # The router cannot reach this worker_url: it accepts the worker and never lists it.
    link, _log, _ = make_link(
        client, router.url, f"http://127.0.0.1:{free_port()}", confirm_timeout=1.0
    )
    try:
        assert await link.register_once() is False
        assert "did not list it within 1s" in (link.state.last_error or "")
        assert "router.worker_url" in (link.state.last_error or "")
        assert link.state.registered is False
    finally:
        await link.close()


async def test_drain_waits_for_in_flight_requests(
    router: RouterProcess, launch: Launcher, client: httpx.AsyncClient
) -> None:
    replica = launch(env={"STANDIN_FAULT": "slow-decode", "STANDIN_SLOW_DECODE_SECONDS": "1.5"})
    link, _, _ = make_link(client, router.url, replica.url(""), drain_timeout=10)
    try:
        link.want_registered()
        await wait_until_async(lambda: link.state.registered, 15.0, "registered")
        request = asyncio.ensure_future(
            client.post(router.url + "/generate", json=GENERATE, timeout=20)
        )
        await wait_until_async(
            lambda: replica.metric("sglang:num_running_reqs") > 0, 15.0, "the request running"
        )
        link.begin_deregister("restart", wait_idle=True)
        result = await link.settled()
        assert result is not None and result.idle, result
        assert request.done() and (await request).status_code == 200
        assert result.waited_s > 0.3
        assert link.status()["last_drain"]["idle"] is True
    finally:
        link.begin_deregister("cleanup")
        await link.close()


async def test_drain_gives_up_at_drain_timeout(
    router: RouterProcess, launch: Launcher, client: httpx.AsyncClient
) -> None:
    replica = launch(env={"STANDIN_FAULT": "decode-hang", "STANDIN_HANG_AFTER_DECODES": "0"})
    link, _, metrics = make_link(client, router.url, replica.url(""), drain_timeout=0.6)
    try:
        hung = asyncio.ensure_future(client.post(replica.url("/generate"), json=GENERATE))
        await wait_until_async(
            lambda: replica.metric("sglang:num_running_reqs") > 0, 15.0, "the request running"
        )
        began = time.monotonic()
        result = await link.drain_idle()
        assert 0.6 <= time.monotonic() - began < 2.0
        assert not result.idle and result.running == 1
        assert "not idle after router.drain_timeout 0.6s (1 running, 0 queued)" in (
            result.error or ""
        )
        assert sample(metrics, "kimi_serve_router_errors_total", op="drain") == 1
        hung.cancel()
    finally:
        await link.close()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["router", "smg_router"])
async def test_a_removal_lost_by_the_router_is_caught_by_the_keep_out_loop(
    which: str, request: pytest.FixtureRequest, launch: Launcher, client: httpx.AsyncClient
) -> None:
    """sglang-router 0.3.2 accepts a DELETE while it is still adding the worker, then lists
    the worker anyway; SMG 1.13 does not list a worker it is adding (nothing to DELETE), then
    lists it. While unregistered, the link keeps removing it."""
    router: RouterProcess = request.getfixturevalue(which)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    link, log, _ = make_link(client, router.url, url, confirm_timeout=0.3)
    try:
        assert await link.register_once() is False  # nothing listens yet: accepted, pending
        link.begin_deregister("stop")
        await link.settled()
        replica = launch(port=port)
        # The router completes the pending addition: it reads /server_info of the worker.
        await wait_until_async(
            lambda: replica.count('"GET /server_info') > 0, 15.0, "the router to add it"
        )
        await wait_until_async(lambda: url not in router.urls(), 15.0, "it to be removed again")
        await wait_until_async(
            lambda: any(
                e.startswith("router lists this SGLang while it must not") for e, _ in log.lines
            ),
            15.0,
            "the removal logged",
        )
        before = served(replica)
        r = await client.post(router.url + "/generate", json=GENERATE, timeout=10)
        # The shared router has no other worker now (SMG: only this one, draining).
        assert r.status_code == 503, r.text
        assert served(replica) == before
    finally:
        await link.close()
