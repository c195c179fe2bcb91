"""RouterLink against the real sglang-router on loopback, with stand-in SGLang replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from supervisor.config import RouterConfig
from supervisor.metrics import Metrics
from supervisor.router import RouterLink
from testkit.router import RouterProcess, free_port
from testkit.standin import Standin
from tests.standin.conftest import Launcher

GENERATE = {"text": "Say hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


class Recorder:
    """A structlog-shaped logger that keeps what it was told."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))

    def errors(self) -> list[str]:
        return [str(kw.get("error")) for e, kw in self.lines if e == "router call failed"]


async def until(what: str, check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.02)


def served(standin: Standin) -> int:
    return standin.count('"POST /generate')


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


def make_link(
    client: httpx.AsyncClient,
    router_url: str,
    worker_url: str,
    drain_timeout: float = 5.0,
    **kw: Any,
) -> tuple[RouterLink, Recorder, Metrics]:
    cfg = RouterConfig(url=router_url, worker_url=worker_url, drain_timeout=drain_timeout)
    log = Recorder()
    metrics = Metrics(CollectorRegistry())
    opts: dict[str, Any] = {
        "request_timeout": 2.0,
        "confirm_timeout": 3.0,
        "recheck_interval": 0.2,
        "backoff_initial": 0.05,
        "backoff_max": 0.3,
        "poll_interval": 0.05,
    }
    opts.update(kw)
    return RouterLink(cfg, client, log, metrics, **opts), log, metrics


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
        await until("registered", lambda: link.state.registered)
        assert url in router.urls()
        wid = link.status()["worker_id"]
        assert wid in [w["id"] for w in router.workers()]
        assert sample(metrics, "kimi_serve_router_registered") == 1

        before = served(replica)
        for _ in range(5):
            r = await client.post(router.url + "/generate", json=GENERATE, timeout=10)
            assert r.status_code == 200, r.text
        await until("the replica to log 5 requests", lambda: served(replica) == before + 5)

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
        await until("both registered", lambda: la.state.registered and lb.state.registered)
        await lb.begin_deregister("restart")
        before_a, before_b = served(a), served(b)
        for _ in range(10):
            r = await client.post(router.url + "/generate", json=GENERATE, timeout=10)
            assert r.status_code == 200
        await until("a served all 10", lambda: served(a) == before_a + 10)
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
        await until("registered", lambda: link.state.registered)
        old = link.state.worker_id
        # Someone else removes it behind our back.
        r = await client.delete(f"{router.url}/workers/{old}")
        assert r.status_code == 202
        await until(
            "a new id", lambda: link.state.registered and link.state.worker_id not in (None, old)
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
        await until("registered", lambda: link.state.registered)
        old = link.state.worker_id
        own.kill()
        await until("the failure noticed", lambda: link.state.last_error is not None)
        assert "cannot connect" in (link.state.last_error or ""), link.state.last_error
        # Supervision is not held up: a deregistration against a dead router ends, bounded.
        began = time.monotonic()
        own.start()  # same port; it has forgotten every worker
        await until(
            "registered with the restarted router",
            lambda: link.state.registered and replica.url("") in own.urls(),
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
        await until("registered", lambda: link.state.registered)
        request = asyncio.ensure_future(
            client.post(router.url + "/generate", json=GENERATE, timeout=20)
        )
        await until("the request running", lambda: replica.metric("sglang:num_running_reqs") > 0)
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
        await until("the request running", lambda: replica.metric("sglang:num_running_reqs") > 0)
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
async def test_a_removal_lost_by_the_router_is_caught_by_the_keep_out_loop(
    router: RouterProcess, launch: Launcher, client: httpx.AsyncClient
) -> None:
    """sglang-router 0.3.2 accepts a DELETE while it is still adding the worker, then lists
    the worker anyway. While unregistered, the link keeps removing it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    link, log, _ = make_link(client, router.url, url, confirm_timeout=0.3)
    try:
        assert await link.register_once() is False  # nothing listens yet: accepted, pending
        link.begin_deregister("stop")
        await link.settled()
        replica = launch(port=port)
        # The router completes the pending addition: it reads /server_info of the worker.
        await until("the router to add it", lambda: replica.count('"GET /server_info') > 0)
        await until("it to be removed again", lambda: url not in router.urls())
        await until(
            "the removal logged",
            lambda: any(
                e.startswith("router lists this SGLang while it must not") for e, _ in log.lines
            ),
        )
        before = served(replica)
        r = await client.post(router.url + "/generate", json=GENERATE, timeout=10)
        assert r.status_code == 503  # the shared router has no other worker now
        assert served(replica) == before
    finally:
        await link.close()
