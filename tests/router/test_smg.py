"""SMG 1.13's own windows, measured against the real `smg` with stand-in workers, and the link
carrying each one (docs/fleet.md, "SMG"):

- registration is asynchronous: 202, and the worker is listed only after SMG's add job saw its
  /health pass (polled every `--worker-startup-check-interval`);
- a second POST meanwhile answers 409 `WORKER_CREATE_IN_PROGRESS`, a POST of a listed URL 409
  `WORKER_ALREADY_EXISTS`;
- a removed worker stays listed as `draining` (routed nothing) for SMG's drain settle time,
  5 s, and a POST for its URL answers 409 meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from testkit.router import GENERATE, RouterProcess, make_link, routed
from testkit.standin import Launcher
from testkit.wait import wait_until_async

SETTLE_S = 5.0  # SMG's drain_settle_secs default (not a flag of `smg launch`)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
        yield c


def entries(router: RouterProcess, url: str) -> list[dict[str, Any]]:
    return [w for w in router.workers() if w["url"].rstrip("/") == url.rstrip("/")]


def code(r: httpx.Response) -> tuple[int, str | None]:
    return r.status_code, r.json().get("code")


async def test_smg_registration_and_removal_windows(
    smg_router: RouterProcess, launch: Launcher, client: httpx.AsyncClient
) -> None:
    # /health answers 503 for its first 2 s (as SGLang's does until its warm-up request).
    replica = launch(env={"STANDIN_WARMUP_SECONDS": "2"}, ready=False)
    url = replica.url("").rstrip("/")
    add = await client.post(smg_router.url + "/workers", json={"url": url})
    assert add.status_code == 202, add.text
    wid = add.json()["worker_id"]
    again = await client.post(smg_router.url + "/workers", json={"url": url})
    assert code(again) == (409, "WORKER_CREATE_IN_PROGRESS"), again.text
    assert not [w for w in entries(smg_router, url) if routed(w)], "routed before /health"
    replica.wait_ready()
    up = time.monotonic()
    await wait_until_async(lambda: url in smg_router.urls(), 10.0, "listed after /health")
    listed_after = time.monotonic() - up
    assert listed_after < 2.5, listed_after  # --worker-startup-check-interval 1
    (entry,) = entries(smg_router, url)
    assert entry["id"] == wid and entry["status"] == "ready" and entry["is_healthy"] is True
    known = await client.post(smg_router.url + "/workers", json={"url": url})
    assert code(known) == (409, "WORKER_ALREADY_EXISTS"), known.text

    removed = await client.delete(f"{smg_router.url}/workers/{wid}")
    assert removed.status_code == 202, removed.text
    began = time.monotonic()
    await wait_until_async(
        lambda: (
            [(w["status"], w["is_healthy"]) for w in entries(smg_router, url)]
            == [("draining", False)]
        ),
        2.0,
        "listed as draining",
    )
    during = await client.post(smg_router.url + "/workers", json={"url": url})
    assert code(during) == (409, "WORKER_ALREADY_EXISTS"), during.text
    before = replica.count('"POST /generate')
    # Nothing else is listed: with only a draining entry SMG answers 503, and sends nothing.
    r = await client.post(smg_router.url + "/generate", json=GENERATE)
    assert code(r)[0] == 503 and replica.count('"POST /generate') == before, r.text
    await wait_until_async(lambda: not entries(smg_router, url), 3 * SETTLE_S, "gone")
    draining_s = time.monotonic() - began
    assert SETTLE_S - 0.5 < draining_s < SETTLE_S + 2, draining_s
    empty = await client.post(smg_router.url + "/generate", json=GENERATE)
    assert empty.status_code == 404 and "model_not_found" in empty.text, empty.text
    print(f"\n[smg] /health passing -> listed {listed_after:.2f}s; draining {draining_s:.2f}s")


async def test_the_link_waits_out_the_draining_window_and_registers_again(
    smg_router: RouterProcess, launch: Launcher, client: httpx.AsyncClient
) -> None:
    """A replica back within SMG's 5 s drain settle (a quick restart, an undrain): the link
    does not POST into the 409, nor DELETE the draining entry (which would end SMG's drain of
    the old requests at once); it registers once the entry is gone, without a failure."""
    replica = launch()
    url = replica.url("").rstrip("/")
    link, log, metrics = make_link(client, smg_router.url, url)
    try:
        link.want_registered()
        await wait_until_async(lambda: link.state.registered, 15.0, "registered")
        old = link.state.worker_id
        await link.begin_deregister("restart")
        assert [w["status"] for w in entries(smg_router, url)] == ["draining"]
        assert not link.state.registered
        began = time.monotonic()
        link.want_registered()
        await wait_until_async(lambda: link.state.registered, 3 * SETTLE_S, "registered again")
        waited = time.monotonic() - began
        assert link.state.worker_id not in (None, old)
        assert [w["id"] for w in entries(smg_router, url)] == [link.state.worker_id]
        assert any(e == "router: waiting for its draining entry to go" for e, _ in log.lines)
        assert log.errors() == [], log.errors()
        errors = metrics.registry.get_sample_value(
            "kimi_serve_router_errors_total", {"op": "register"}
        )
        assert errors == 0, errors
        print(f"\n[smg] deregistered -> registered again {waited:.2f}s")
    finally:
        await link.begin_deregister("cleanup")
        await link.close()


async def test_the_link_adopts_an_addition_in_progress(
    smg_router: RouterProcess, launch: Launcher, client: httpx.AsyncClient
) -> None:
    """SMG lists a worker only once its /health passes; a link that gave up waiting (after
    confirm_timeout) POSTs again and gets 409 `WORKER_CREATE_IN_PROGRESS`: it waits for the
    entry SMG is adding, never a failed HTTP status."""
    replica = launch(env={"STANDIN_WARMUP_SECONDS": "2.5"}, ready=False)
    url = replica.url("").rstrip("/")
    link, log, _ = make_link(client, smg_router.url, url, confirm_timeout=1.0)
    try:
        link.want_registered()
        await wait_until_async(lambda: link.state.registered, 15.0, "registered")
        (entry,) = entries(smg_router, url)
        assert link.state.worker_id == entry["id"] and entry["status"] == "ready"
        codes = [kw["code"] for e, kw in log.lines if e == "router: knows this URL already"]
        assert "WORKER_CREATE_IN_PROGRESS" in codes, log.lines
        assert not [e for e in log.errors() if "409" in e], log.errors()
    finally:
        await link.begin_deregister("cleanup")
        await link.close()
