"""Free ports and waiting with a deadline."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Under pytest-xdist (`scripts/test --quick`) each worker hands out ports from its own slice of
# PORT_BASE.. (below Linux's ephemeral range, 32768-60999, which port 0 draws from), so two
# workers never both pick a port that one of them released and is about to bind again.
PORT_BASE, PORTS_PER_WORKER, MAX_WORKERS = 20000, 1500, 8
_handed_out = itertools.count()


def free_port() -> int:
    """A loopback TCP port free right now (tests run side by side: never a fixed port)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    base = PORT_BASE + (int(worker[2:]) % MAX_WORKERS) * PORTS_PER_WORKER
    for _ in range(PORTS_PER_WORKER):
        port = base + next(_handed_out) % PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or still in TIME_WAIT from an earlier test
            return port
    raise RuntimeError(f"no free port in {base}-{base + PORTS_PER_WORKER - 1}")


def wait_until(
    cond: Callable[[], T] | threading.Event,
    timeout: float,
    what: str = "condition",
    interval: float = 0.02,
) -> T | Any:
    """The predicate's first truthy value (or True for an event), within `timeout` seconds.

    A `threading.Event` is waited on without polling. Raises AssertionError naming `what`.
    """
    if isinstance(cond, threading.Event):
        if not cond.wait(timeout):
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        return True
    came, value = poll(cond, timeout, interval)
    if not came:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
    return value


async def wait_until_async(
    cond: Callable[[], T],
    timeout: float,
    what: str = "condition",
    interval: float = 0.02,
    *,
    in_thread: bool = False,
) -> T:
    """`wait_until` for a coroutine: the event loop keeps running between the checks.

    `in_thread` runs a blocking predicate (an HTTP call, a file read) in a worker thread.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(cond) if in_thread else cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


def poll(cond: Callable[[], T], timeout: float, interval: float = 0.02) -> tuple[bool, T]:
    """(True, the first truthy value) within `timeout` seconds, else (False, the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return True, value
        if time.monotonic() >= deadline:
            return False, value
        time.sleep(interval)
