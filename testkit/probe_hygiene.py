"""Timed-out probes must not pile up inside SGLang: a check that takes any server's URL.

`timed_out_probes_leave_nothing_running(url, ...)` sends probes that time out and then waits for
SGLang's own `sglang:num_running_reqs` (its /metrics, --enable-metrics) to return to 0. It is
used against the stand-in here and written to run unchanged against a real SGLang: give it a
probe config whose decode takes longer than `timeout` (many tokens on a CPU server).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from supervisor.config import ProbeConfig
from supervisor.sglang.probe import ProbeGate, ProbeResult, probe, read_progress


@dataclass
class Outcome:
    results: list[ProbeResult] = field(default_factory=list)
    running_during: float | None = None  # num_running_reqs right after the probes gave up
    running_after: float | None = None  # at the end of the wait (0 is the pass)
    settled_s: float | None = None  # seconds until it was 0; None if it never was
    max_in_flight: int = 0


async def timed_out_probes_leave_nothing_running(
    url: str,
    cfg: ProbeConfig,
    *,
    count: int = 3,
    timeout: float = 0.3,
    settle: float = 10.0,
    abort: bool = True,
) -> Outcome:
    """Run `count` probes of `timeout` seconds (concurrently asked for, as racing timers would:
    the gate lets one through at a time), then poll SGLang's running count until it is 0 or
    `settle` seconds pass. `abort=False` sends the same probes with no rid and no abort: the
    control that shows the check can fail."""
    out = Outcome()
    gate = ProbeGate()
    async with httpx.AsyncClient(trust_env=False) as client:
        if abort:
            jobs = [gate.probe(client, url, cfg, False, timeout=timeout) for _ in range(count)]
        else:
            jobs = [probe(client, url, cfg, False, timeout=timeout) for _ in range(count)]
        out.results = list(await asyncio.gather(*jobs))
        out.max_in_flight = gate.max_in_flight
        first = await read_progress(client, url)
        out.running_during = first.running_requests if first else None
        start = time.monotonic()
        while True:
            now = await read_progress(client, url)
            out.running_after = now.running_requests if now else None
            if out.running_after == 0:
                out.settled_s = time.monotonic() - start
                break
            if time.monotonic() - start > settle:
                break
            await asyncio.sleep(0.05)
    return out


async def unaborted_probes_keep_running(
    url: str, cfg: ProbeConfig, *, count: int = 3, ceiling: float = 120.0
) -> Outcome:
    """The control, event by event rather than by the clock: `count` probes with no rid and
    no abort are sent; once SGLang reports one of them running (however long a loaded machine
    takes to get there, up to `ceiling`), the client gives up on all of them, as a probe's
    timeout does; `running_after` is SGLang's running count read right after. Nothing told
    SGLang, so they are still decoding (until its own disconnect check, seconds later)."""
    out = Outcome()
    async with httpx.AsyncClient(trust_env=False) as client:
        jobs = [
            asyncio.create_task(probe(client, url, cfg, False, timeout=ceiling))
            for _ in range(count)
        ]
        start = time.monotonic()
        try:
            while time.monotonic() - start < ceiling:
                now = await read_progress(client, url)
                if now is not None and now.running_requests >= 1:
                    out.running_during = now.running_requests
                    break
                await asyncio.sleep(0.05)
        finally:
            for job in jobs:
                job.cancel()  # the client gives up, as at a timeout: connections closed
            await asyncio.gather(*jobs, return_exceptions=True)
        after = await read_progress(client, url)
        out.running_after = after.running_requests if after else None
    return out
