"""Free ports and waiting with a deadline."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A loopback TCP port free right now (tests run side by side: never a fixed port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
