"""Two replicas, each run by the real `kimi-serve run` (stand-in SGLang), behind a real router,
with the load generator sending plain and streaming requests through the router for the whole
test. The flows every router must carry (restart, reload and stop under streams, drain and
undrain, the seed incident) run behind sglang-router 0.3.2 and behind SMG 1.13 with the flags
docs/fleet.md chooses; SMG's own windows (asynchronous registration, `draining`, 409) are
tests/router/test_smg.py. What users feel is counted: failed requests, cut streams, and user
requests that reached a replica which was not decode-verified (its stand-in's request log).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.loadgen import LoadGenerator, Stats
from testkit.daemon import BIN, DaemonProcess
from testkit.fleet import (
    ListWatch,
    event_time,
    registered,
    replica_config,
    replicas,
    user_arrivals,
    worker_url,
)
from testkit.router import LEGACY, ROUTERS, SMG, SMG_FLEET_FLAGS, RouterProcess
from testkit.wait import wait_until_async

pytestmark = pytest.mark.slow

# Round robin: the default cache-aware policy sends prompts with a common prefix to one
# replica, so the replica a step is about might see no traffic at all. Pending additions give
# up after 10 s (a stand-in of a later test may get the port of an earlier one).
ROUTER_FLAGS = ["--policy", "round_robin", "--worker-startup-timeout-secs", "10"]
FLAGS = {LEGACY: ROUTER_FLAGS, SMG: [*SMG_FLEET_FLAGS, *ROUTER_FLAGS]}
LIVENESS_S = 1.0  # liveness.interval in replica_config
both = pytest.mark.parametrize("fleet_router", ROUTERS, indirect=True)


@pytest.fixture(scope="module")
def fleet_router(request: pytest.FixtureRequest) -> Iterator[RouterProcess]:
    """One router per kind for the module; sglang-router where a test names none."""
    kind = getattr(request, "param", LEGACY)
    proc = RouterProcess(FLAGS[kind], kind=kind).start()
    yield proc
    proc.cleanup()


def no_router_error(*daemons: DaemonProcess) -> None:
    """The link carried every step without a failed router call (SMG's 409 and `draining`
    windows included)."""
    for d in daemons:
        router = d.status()["router"]
        assert router["last_error"] is None, router


async def ready_and_registered(d: DaemonProcess, timeout: float = 30.0) -> None:
    await asyncio.to_thread(d.wait_state, "ready", timeout)
    await wait_until_async(
        lambda: registered(d), timeout, "registered", interval=0.05, in_thread=True
    )


async def more(load: LoadGenerator, n: int) -> None:
    await load.wait_for(len(load.outcomes) + n, timeout=30)


def clean(stats: Stats) -> None:
    assert stats.sent > 0 and stats.streams > 0, stats.to_dict()
    assert stats.failed == 0, stats.to_dict()
    assert stats.streams_cut == 0, stats.to_dict()


async def unlisted_within_liveness(
    watch: ListWatch, cfg: dict[str, Any], knew: float, what: str
) -> float:
    """Wait for the replica to leave the router's list after `knew` (when kimi-serve knew);
    it must have left within one liveness interval. Returns when it left."""
    await wait_until_async(
        lambda: watch.first_unlisted_after(worker_url(cfg), knew) is not None,
        LIVENESS_S + 5,
        what,
        interval=0.05,
        in_thread=True,
    )
    out = watch.first_unlisted_after(worker_url(cfg), knew)
    assert out is not None and out - knew <= LIVENESS_S, (out, knew)
    return out


def line_index(d: DaemonProcess, text: str, after: int = 0) -> int:
    for i, line in enumerate(d.raw[after:], after):
        if text in line:
            return i
    raise AssertionError(f"{text!r} not in the daemon's output: {d.raw[-20:]}")


@both
async def test_restart_reload_and_stop_cut_nothing(
    fleet_router: RouterProcess, tmp_path: Path
) -> None:
    a_cfg = replica_config(tmp_path / "a", fleet_router.url)
    b_cfg = replica_config(tmp_path / "b", fleet_router.url)
    with replicas((tmp_path / "a", a_cfg), (tmp_path / "b", b_cfg)) as (a, b):
        await asyncio.gather(ready_and_registered(a), ready_and_registered(b))
        assert {worker_url(a_cfg), worker_url(b_cfg)} <= set(fleet_router.urls())
        load = await LoadGenerator(fleet_router.url, concurrency=4, stream_every=2).start()
        try:
            await more(load, 20)
            assert user_arrivals(b_cfg), "round robin sends B its share"

            # POST /restart on B: out of the list, drained, restarted, back in.
            start = load.mark("restart")
            assert b.post("/restart").status_code == 202
            await asyncio.to_thread(b.wait_state, "restarting")
            await ready_and_registered(b)
            await more(load, 20)
            restart = load.stats(since=start)
            assert worker_url(b_cfg) in fleet_router.urls()

            # A reload (SIGHUP, changed file) on A restarts its SGLang the same way.
            start = load.mark("reload")
            a_cfg["sglang"]["env"]["STANDIN_WARMUP_SECONDS"] = "0.15"
            a.config_path.write_text(yaml.safe_dump(a_cfg))
            a.signal(signal.SIGHUP)
            await asyncio.to_thread(a.wait_state, "restarting")
            await ready_and_registered(a)
            await more(load, 20)
            reload = load.stats(since=start)
            no_router_error(a, b)

            # A stop of B (what `systemctl stop` sends): deregistered before SGLang's SIGTERM.
            start = load.mark("stop")
            mark = len(b.raw)
            code = await asyncio.to_thread(b.stop)
            assert code == 0
            deregistered = line_index(b, "router: deregistered", mark)
            sigterm = line_index(b, "SIGTERM received", mark)
            assert deregistered < sigterm, b.raw[mark:]
            assert worker_url(b_cfg) not in fleet_router.urls()
            await more(load, 20)
            stop = load.stats(since=start)
        finally:
            await load.stop()
        for phase in (restart, reload, stop):
            clean(phase)
        clean(load.stats())


async def test_killed_and_hung_sglang_leave_the_list_and_get_nothing(
    fleet_router: RouterProcess, tmp_path: Path
) -> None:
    """SIGKILL of one replica's SGLang; a decode hang on the other (/health still 200)."""
    a_cfg = replica_config(tmp_path / "a", fleet_router.url)
    # The hang begins after a few decodes (probes included), on the first launch only.
    hang = {
        "STANDIN_FAULT": "decode-hang",
        "STANDIN_HANG_AFTER_DECODES": "30",
        "STANDIN_FAULT_LAUNCH": "1",
    }
    b_cfg = replica_config(tmp_path / "b", fleet_router.url, hang)
    with (
        replicas((tmp_path / "a", a_cfg), (tmp_path / "b", b_cfg)) as (a, b),
        ListWatch(fleet_router.url) as watch,
    ):
        await asyncio.gather(ready_and_registered(a), ready_and_registered(b))
        load = await LoadGenerator(
            fleet_router.url, concurrency=4, stream_every=2, timeout=15
        ).start()
        try:
            # B hangs once it has decoded 30 requests: kimi-serve's liveness probe notices.
            degraded = await asyncio.to_thread(b.wait_state, "degraded", 60)
            knew = event_time(degraded)
            out = await unlisted_within_liveness(watch, b_cfg, knew, "B out of the list")
            await asyncio.to_thread(b.wait_state, "ready", 60)
            back = event_time(b.seen[-1])
            hung_after = [t for t in user_arrivals(b_cfg) if out < t < back]
            assert hung_after == [], f"{len(hung_after)} user requests reached the hung B"

            # SIGKILL of A's SGLang: kimi-serve knows at once (the child's exit).
            await wait_until_async(
                lambda: registered(b), 30.0, "B registered again", interval=0.05, in_thread=True
            )
            await more(load, 10)
            mark = len(a.seen)
            a_pid = await asyncio.to_thread(a.sglang_pid)
            os.kill(a_pid, signal.SIGKILL)
            restarting = await asyncio.to_thread(a.wait_state, "restarting")
            assert len(a.seen) > mark
            knew = event_time(restarting)
            await unlisted_within_liveness(watch, a_cfg, knew, "A out of the list")
            ready = await asyncio.to_thread(a.wait_state, "ready", 30)
            before_verified = [t for t in user_arrivals(a_cfg) if knew < t < event_time(ready)]
            assert before_verified == [], "user requests reached A's new launch before ready"
            await wait_until_async(
                lambda: registered(a), 30.0, "A registered again", interval=0.05, in_thread=True
            )
            await more(load, 10)
        finally:
            await load.stop()


@both
async def test_seed_incident_launch_gets_no_user_request(
    fleet_router: RouterProcess, tmp_path: Path
) -> None:
    a_cfg = replica_config(tmp_path / "a", fleet_router.url)
    # Healthy by /health, dead on its first real decode (kimi-serve's probe), first launch only.
    seed = {"STANDIN_FAULT": "seed-incident", "STANDIN_FAULT_LAUNCH": "1"}
    b_cfg = replica_config(tmp_path / "b", fleet_router.url, seed)
    with replicas((tmp_path / "a", a_cfg)) as (a,):
        await ready_and_registered(a)
        load = await LoadGenerator(fleet_router.url, concurrency=3, stream_every=2).start()
        try:
            await more(load, 5)
            with replicas((tmp_path / "b", b_cfg)) as (b,):
                ready = await asyncio.to_thread(b.wait_state, "ready", 60)
                assert "restarting" in b.states(), "the first launch failed its decode probe"
                verified = event_time(ready)
                await wait_until_async(
                    lambda: registered(b), 30.0, "registered", interval=0.05, in_thread=True
                )
                await more(load, 20)
                arrivals = user_arrivals(b_cfg)
                early = [t for t in arrivals if t < verified]
                assert early == [], f"{len(early)} user requests before decode-verified"
                assert [t for t in arrivals if t > verified], "B serves once verified"
        finally:
            stats = await load.stop()
        clean(stats)


async def test_router_down_then_up_registers_again(tmp_path: Path) -> None:
    router = RouterProcess(ROUTER_FLAGS).start()
    port = router.port
    try:
        cfg = replica_config(tmp_path / "a", router.url)
        with replicas((tmp_path / "a", cfg)) as (a,):
            await ready_and_registered(a)
            router.kill()
            await wait_until_async(
                lambda: "cannot connect" in str((a.status()["router"] or {})["last_error"]),
                15,
                "the link notices",
                interval=0.05,
                in_thread=True,
            )
            assert a.status()["state"] == "ready"
            router = RouterProcess(ROUTER_FLAGS, port=port).start()
            await wait_until_async(
                lambda: worker_url(cfg) in router.urls(),
                30,
                "listed by the new router",
                interval=0.05,
                in_thread=True,
            )
            await wait_until_async(
                lambda: registered(a), 10, "registered", interval=0.05, in_thread=True
            )
            assert a.status()["state"] == "ready"
    finally:
        router.cleanup()


def cli(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN), *args, "--config", str(d.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@both
async def test_drain_and_undrain_commands(fleet_router: RouterProcess, tmp_path: Path) -> None:
    cfg = replica_config(tmp_path / "a", fleet_router.url)
    with replicas((tmp_path / "a", cfg)) as (a,):
        await ready_and_registered(a)
        needless = await asyncio.to_thread(cli, a, "undrain")
        assert needless.returncode == 0 and "nothing to do: not draining" in needless.stdout
        drained = await asyncio.to_thread(cli, a, "drain")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        # Answered only once the router's list confirms the removal and SGLang is idle.
        assert worker_url(cfg) not in fleet_router.urls()
        status = a.status()
        assert status["state"] == "draining"
        assert status["router"]["registered"] is False
        assert status["router"]["last_drain"]["idle"] is True
        assert a.get("/readyz").status_code == 503
        undrained = await asyncio.to_thread(cli, a, "undrain")
        assert undrained.returncode == 0, undrained.stdout + undrained.stderr
        await wait_until_async(
            lambda: registered(a), 30.0, "registered again", interval=0.05, in_thread=True
        )
        assert worker_url(cfg) in fleet_router.urls()
        assert a.get("/readyz").status_code == 200
        no_router_error(a)
