"""The drain's wait: SGLang's running + queued requests (its /metrics) polled until they reach
0, bounded by router.drain_timeout. Used with a router (`RouterLink.drain_idle`) and without
one (`POST /drain` without router.url). Never raises."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from supervisor.sglang import endpoints


def parse_load(text: str) -> tuple[float, float] | None:
    """(running, queued) requests from SGLang's /metrics, summed over ranks; None if absent."""
    return load_of(endpoints.parse_metrics(text))


def load_of(samples: endpoints.Samples | None) -> tuple[float, float] | None:
    """`parse_load` of samples already parsed."""
    running = None if samples is None else endpoints.total(samples, "sglang:num_running_reqs")
    if samples is None or running is None:
        return None
    return running, endpoints.total(samples, "sglang:num_queue_reqs") or 0.0


@dataclass(frozen=True)
class DrainResult:
    idle: bool  # SGLang had no running or queued request at the end
    waited_s: float
    running: float | None
    queued: float | None
    error: str | None = None

    def to_status(self) -> dict[str, Any]:
        return {
            "idle": self.idle,
            "waited_s": round(self.waited_s, 3),
            "running": self.running,
            "queued": self.queued,
            "error": self.error,
        }


async def sglang_load(
    client: httpx.AsyncClient, sglang_url: str, timeout: float
) -> tuple[tuple[float, float] | None, str | None]:
    """(running, queued) from SGLang's /metrics, or why it cannot be read."""
    text, why = await endpoints.get_metrics(client, sglang_url, timeout)
    if text is None:
        return None, why
    load = load_of(await endpoints.samples(text))
    if load is None:
        return None, "SGLang's /metrics is not served (no sglang:num_running_reqs in it)"
    return load, None


def waited_for(sglang_url: str, budget: float) -> str:
    """What a drain waits for, in the words its answer gives the operator."""
    return (
        f"SGLang's running and queued requests to reach 0 (sglang:num_running_reqs + "
        f"sglang:num_queue_reqs at {sglang_url.rstrip('/')}/metrics), at most "
        f"router.drain_timeout {budget:g}s"
    )


async def wait_idle(
    client: httpx.AsyncClient,
    sglang_url: str,
    budget: float,
    *,
    request_timeout: float = 3.0,
    clock: Callable[[], float] = time.monotonic,
) -> DrainResult:
    """Poll SGLang's /metrics until it reports no running and no queued request, at most
    `budget` seconds (router.drain_timeout). A drain's wait, with or without a router: the
    requests SGLang is serving end there, whoever sent them. Never raises."""
    start = clock()
    running: float | None = None
    queued: float | None = None
    error: str | None = None
    while True:
        load, error = await sglang_load(client, sglang_url, request_timeout)
        if load is not None:
            running, queued = load
            if running + queued <= 0:
                return DrainResult(True, clock() - start, running, queued)
        elif error is not None and "not served" in error:
            # No metrics: there is nothing to wait on; the stop's own drain still applies.
            return DrainResult(False, clock() - start, None, None, error)
        if clock() - start >= budget:
            what = error or f"{running:g} running, {queued:g} queued"
            return DrainResult(
                False,
                clock() - start,
                running,
                queued,
                f"not idle after router.drain_timeout {budget:g}s ({what})",
            )
        await asyncio.sleep(min(0.25, max(0.0, budget - (clock() - start))))
