"""Two real SGLang 0.5.23 servers, each run by the real `kimi-serve run` with `router.url` set,
behind the real sglang-router 0.3.2 and then, moved by a reload that keeps SGLang running,
behind the real SMG 1.13 (with docs/fleet.md's flags): behind each, a manual restart of one
fails no request and cuts no stream. What only a real server shows: SMG adds a relaunched
SGLang once its own /health passes, which real SGLang holds at 503 until its warm-up request
is done, after kimi-serve's decode probe; the time from `ready` to listed is printed.

Both servers start at once (each takes 20-60 s on two cores) and serve both routers; the load
generator sends plain and streaming requests through the router for the whole test.

Both replicas share this host's two cores, which a fleet never does: while B's SGLang loads
(tens of seconds at full CPU), A's 8-token liveness probe can outlast the suite's usual 5 s
timeout. A failed probe takes A out of the router (`degraded`); with B out for its restart
the router then has no worker and answers 503 `no_available_workers` to everything until A is
back (docs/fleet.md, "No worker left"). That is kimi-serve working as designed, not the restart
path this test is about, so A's liveness timeout here is the contract's default (20 s): only a
real hang takes it out. The test also checks that A never left `ready`, and on failure prints
the timeline of both daemons, the router's list and every failed request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import LoadGenerator
from testkit import realsglang as real
from testkit.fleet import ListWatch, event_time, registered
from testkit.realsglang import LOAD_TIMEOUT, Real, daemon_config, real_daemon
from testkit.router import SMG, SMG_FLEET_FLAGS, RouterProcess, router_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

if not router_available() or not router_available(SMG):
    pytest.skip("sglang-router or smg is not installed", allow_module_level=True)

LIVENESS = {"interval": "2s", "timeout": "20s", "failure_threshold": 3}


@contextlib.contextmanager
def fleet(tmp: Path, sgl: real.SGLangEnv, router: RouterProcess) -> Iterator[tuple[Real, Real]]:
    with contextlib.ExitStack() as stack:
        pair = []
        for name in ("a", "b"):
            (tmp / name).mkdir()
            cfg = daemon_config(
                tmp / name,
                sgl,
                router={"url": router.url, "drain_timeout": "20s"},
                # Two real servers loading at once on two shared cores.
                readiness={"load_timeout": f"{2 * LOAD_TIMEOUT:g}s"},
                liveness=LIVENESS,
            )
            pair.append(stack.enter_context(real_daemon(tmp / name, cfg)))
        yield pair[0], pair[1]


async def until_registered(r: Real, timeout: float) -> float:
    """Waits for `ready`, then for the link to say registered; returns when it was ready."""
    ready = await asyncio.to_thread(r.wait_ready, timeout)
    await until_linked(r)
    return event_time(ready)


async def until_linked(r: Real, router_url: str | None = None) -> None:
    """Registered (with `router_url`, where given: a reload moves the link on its own time)."""

    def linked() -> bool:
        status = r.d.status().get("router") or {}
        return registered(r.d) and router_url in (None, status.get("url"))

    deadline = asyncio.get_running_loop().time() + 30
    while not await asyncio.to_thread(linked):
        if asyncio.get_running_loop().time() > deadline:
            lines = [x for x in r.d.raw if '"source": "sglang"' not in x]
            raise AssertionError(
                f"not registered within 30 s: {r.d.status()['router']}, {lines[-15:]}"
            )
        await asyncio.sleep(0.1)


def timeline(since: float, load: LoadGenerator, watch: ListWatch, reps: dict[str, Real]) -> str:
    """What happened from 30 s before the restart on: each daemon's state changes and router
    lines, each change of the router's list, each failed request (t relative to the restart)."""
    rows: list[tuple[float, str, str]] = []
    for name, r in reps.items():
        for line in r.d.raw:
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                what = str(ev.get("event", "")) if isinstance(ev, dict) else ""
                if what == "state" or what.startswith(("router", "sglang drained", "probe")):
                    keep = {k: v for k, v in ev.items() if k not in ("timestamp", "level")}
                    rows.append((event_time(ev), name, json.dumps(keep)[:240]))
    for o in load.outcomes:
        if o.result not in ("ok", "stream_ok"):
            rows.append(
                (o.started, "user", f"{o.result} after {o.ended - o.started:.2f}s: {o.error}")
            )
    last: frozenset[str] | None = None
    for at, urls in watch.history:
        if urls != last:
            rows.append((at, "list", " ".join(sorted(urls)) or "(empty)"))
            last = urls
    return "\n".join(
        f"{at - since:8.2f} {who:4} {what}" for at, who, what in sorted(rows) if at >= since - 30
    )


def liveness_latencies(r: Real) -> dict[str, float]:
    """A's liveness probes by duration (kimi_serve_probe_duration_seconds, cumulative)."""
    text = httpx.get(r.d.admin + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket") and s.labels.get("kind") == "liveness":
                key = f"{s.labels.get('outcome')} <= {s.labels['le']}s"
                out[key] = out.get(key, 0.0) + s.value
    return {k: v for k, v in out.items() if v}


async def restart_b_under_load(
    router: RouterProcess, a: Real, b: Real, watch: ListWatch
) -> tuple[dict[str, Any], float]:
    """`POST /restart` of B with plain and streaming load through `router`: what the users
    saw, and B's relaunch from `ready` to listed by the router."""
    load = await LoadGenerator(
        router.url, concurrency=2, stream_every=2, max_new_tokens=8, timeout=120
    ).start()
    try:
        await load.wait_for(6, timeout=120)
        since = load.mark("restart")
        assert b.d.post("/restart").status_code == 202
        await asyncio.to_thread(b.d.wait_state, "restarting", 30)
        ready = await until_registered(b, 2 * LOAD_TIMEOUT)
        await load.wait_for(len(load.outcomes) + 6, timeout=120)
    finally:
        stats = await load.stop()
    story = timeline(since, load, watch, {"a": a, "b": b})
    listed = watch.first_listed_after(b.sglang_url, ready)
    a_states = a.d.states()
    during = load.stats(since=since)
    print(f"\n[realsglang] {router.kind} restart: {stats.to_dict()} during: {during.to_dict()}")
    print(f"[realsglang] A's liveness probes (cumulative): {liveness_latencies(a)}")
    assert listed is not None, story
    print(f"[realsglang] {router.kind}: B ready -> listed {listed - ready:.2f}s")
    context: dict[str, Any] = {"stats": stats.to_dict(), "router log": router.log_tail(30)}
    assert during.sent > 0 and stats.streams > 0, context
    assert a_states[-1] == "ready" and "degraded" not in a_states, (a_states, story)
    assert stats.failed == 0 and stats.streams_cut == 0, (context, story)
    return context, listed - ready


async def test_manual_restart_behind_either_router_fails_nothing(
    sgl: real.SGLangEnv, tmp_path: Path
) -> None:
    legacy = RouterProcess(["--policy", "round_robin"]).start()
    smg = RouterProcess([*SMG_FLEET_FLAGS, "--policy", "round_robin"], kind=SMG).start()
    try:
        with fleet(tmp_path, sgl, legacy) as (a, b):
            await asyncio.gather(
                until_registered(a, 2 * LOAD_TIMEOUT), until_registered(b, 2 * LOAD_TIMEOUT)
            )
            with ListWatch(legacy.url, interval=0.1) as watch:
                await restart_b_under_load(legacy, a, b, watch)

            # Both replicas to SMG: a reload that changes only `router:` keeps SGLang running.
            for r in (a, b):
                r.rewrite(lambda cfg: cfg["router"].update(url=smg.url))
                r.d.signal(signal.SIGHUP)
                moved = await asyncio.to_thread(
                    r.d.wait_for, lambda e: e.get("event") == "router: moved", 30, "moved"
                )
                assert moved["url"] == smg.url, moved
            await asyncio.gather(until_linked(a, smg.url), until_linked(b, smg.url))
            assert {a.sglang_url, b.sglang_url} <= set(smg.urls())
            assert not {a.sglang_url, b.sglang_url} & set(legacy.urls())
            with ListWatch(smg.url, interval=0.1) as watch:
                context, listed_s = await restart_b_under_load(smg, a, b, watch)
            # A relaunch is listed once SMG's add job saw its /health pass: polled every
            # second with --worker-startup-check-interval 1 (its default, 30 s, would be
            # one more poll interval of waiting when the first one fails).
            assert listed_s < 15, context
            for r in (a, b):
                assert r.d.status()["router"]["last_error"] is None, r.d.status()["router"]
    finally:
        legacy.cleanup()
        smg.cleanup()
