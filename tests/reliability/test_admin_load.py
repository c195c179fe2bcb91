"""Scrapes and /status requests hammer the admin endpoint (it shares the daemon's event loop)
while SGLang is SIGKILLed: the death is noticed as fast as without load, and SGLang is ready
again within the same bounds.

Detection time: from the SIGKILL to the timestamp of the daemon's "state new=restarting" event.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.rig import (
    MAX_WATCHDOG_GAP_S,
    Run,
    config,
    event_time,
    is_state,
    segments,
    soak_factor,
    supervised,
    trial,
)

pytestmark = pytest.mark.timeout(120)

CLIENTS = 8
MAX_REQUESTS = 2000
KILLS = 3
# What load may add to the detection median; and the bound on getting back to ready.
EXTRA_DETECTION_S = 0.25
READY_AGAIN_S = 10.0


class Load:
    """CLIENTS concurrent loopback clients alternating /metrics and /status, in a thread.

    It stops by itself after MAX_REQUESTS requests (or when told to)."""

    def __init__(self, admin: str, limit: int = MAX_REQUESTS) -> None:
        self.admin = admin
        self.limit = limit
        self.done = 0
        self.errors: list[str] = []
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.started = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        self.started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    @property
    def active(self) -> bool:
        return self.thread.is_alive() and self.done < self.limit

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(timeout=10, trust_env=False, limits=limits) as client:
            self.started.set()
            await asyncio.gather(*(self._client(client, i) for i in range(CLIENTS)))

    async def _client(self, client: httpx.AsyncClient, i: int) -> None:
        paths = ("/metrics", "/status")
        n = i
        while not self.stop.is_set() and self.done < self.limit:
            self.done += 1
            n += 1
            start = time.monotonic()
            try:
                r = await client.get(self.admin + paths[n % 2])
                if r.status_code != 200:
                    self.errors.append(f"{paths[n % 2]}: HTTP {r.status_code}")
            except httpx.HTTPError as exc:
                self.errors.append(f"{paths[n % 2]}: {exc!r}")
            self.latencies.append(time.monotonic() - start)


def kill_and_recover(run: Run, load: Load | None = None) -> tuple[float, float]:
    """SIGKILL SGLang; (seconds until the daemon said restarting, until ready again)."""
    if load is not None:
        assert load.active, "the load ran out before the kill"
    _, at = run.kill_sglang(signal.SIGKILL)
    restarting = run.d.wait_for(is_state("restarting"), timeout=20, what="restarting")
    assert restarting["reason"] == "exited"
    ready = run.d.wait_for(is_state("ready"), timeout=READY_AGAIN_S + 5, what="ready again")
    return event_time(restarting) - at, event_time(ready) - at


def test_restart_detection_under_admin_load(tmp_path: Path) -> None:
    kills = KILLS * soak_factor()
    # Every kill counts towards a crash loop; this test is not about that.
    cfg = config(tmp_path, restart={"crash_loop": {"max_restarts": 100, "window": "1h"}})
    with (
        trial("admin load", f"SIGKILL of SGLang under {CLIENTS} concurrent admin clients") as t,
        supervised(tmp_path, cfg, t) as run,
    ):
        run.d.wait_state("ready")
        quiet = [kill_and_recover(run) for _ in range(kills)]
        # A fresh load for each kill, so that every kill lands while requests are in flight;
        # together they stay within MAX_REQUESTS (per KILLS kills).
        loaded, errors, latencies, served = [], [], [], 0
        for _ in range(kills):
            with Load(run.d.admin, limit=MAX_REQUESTS // KILLS) as load:
                deadline = time.monotonic() + 5
                while load.done < 20 and time.monotonic() < deadline:
                    time.sleep(0.01)
                loaded.append(kill_and_recover(run, load))
            served += load.done
            errors += load.errors
            latencies += load.latencies
        detect_q = statistics.median(d for d, _ in quiet)
        detect_l = statistics.median(d for d, _ in loaded)
        ready_q = statistics.median(r for _, r in quiet)
        ready_l = statistics.median(r for _, r in loaded)
        t.notes.update(
            detect_quiet_ms=round(detect_q * 1000),
            detect_loaded_ms=round(detect_l * 1000),
            ready_quiet_s=round(ready_q, 2),
            ready_loaded_s=round(ready_l, 2),
            requests=served,
            errors=len(errors),
            p99_ms=round(1000 * sorted(latencies)[int(0.99 * (len(latencies) - 1))]),
        )
        assert not errors, errors[:5]
        assert served <= MAX_REQUESTS * soak_factor()
        assert detect_l - detect_q < EXTRA_DETECTION_S, t.notes
        assert all(r < READY_AGAIN_S for _, r in quiet + loaded), (quiet, loaded)
        assert ready_l - ready_q < 1.0, t.notes
        gap = run.notify.max_watchdog_gap(until=time.monotonic())
        t.notes["watchdog_gap_s"] = round(gap, 2)
        assert gap < MAX_WATCHDOG_GAP_S
        segs = segments(run.events())
        assert len(segs) == 2 * kills + 1
        t.recovered = True


FD_LIMIT = 256


def test_idle_admin_connections_never_stop_a_relaunch(tmp_path: Path) -> None:
    """A scraper that leaks connections (FD_LIMIT+ idle sockets) while SGLang dies."""
    cfg = config(tmp_path, restart={"crash_loop": {"max_restarts": 4, "window": "1h"}})
    limit = (FD_LIMIT, FD_LIMIT)
    with (
        trial(
            "admin load",
            "idle admin connections use up the daemon's file descriptors",
        ) as t,
        supervised(
            tmp_path, cfg, t, preexec=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit)
        ) as run,
        contextlib.ExitStack() as conns,
    ):
        run.d.wait_state("ready")
        pid = run.status()["child"]["pid"]
        host, port = cfg["admin"]["listen"].rsplit(":", 1)
        for _ in range(FD_LIMIT + 50):
            conns.enter_context(socket.create_connection((host, int(port))))
        os.kill(pid, signal.SIGKILL)
        # Held until the daemon has either given up, relaunched anyway, or waited out three
        # host-not-ready retries (what a daemon that knows EMFILE is the host's problem does).
        retries = []

        def settled(e: dict[str, Any]) -> bool:
            if e.get("event") == "state" and e.get("reason") == "host_not_ready":
                retries.append(e)
            return is_state("ready")(e) or is_state("failed")(e) or len(retries) >= 3

        held = run.d.wait_for(settled, timeout=30, what="the relaunch, or its trouble")
        conns.close()  # the scraper goes away
        assert not is_state("failed")(held), f"gave up for good: {held}"
        run.d.wait_for(is_state("ready"), timeout=20, what="ready again")
        t.recovered = True
