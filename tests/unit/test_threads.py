"""The blocking-call adapter: results, errors and deadlines cross back to the loop."""

from __future__ import annotations

import threading

import pytest

from supervisor.threads import in_thread


async def test_the_result_comes_back() -> None:
    assert await in_thread(lambda: threading.current_thread().name, 5.0) == "kimi-serve-io"


async def test_an_error_comes_back() -> None:
    def boom() -> None:
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output error"):
        await in_thread(boom, 5.0)


async def test_a_call_that_never_returns_is_abandoned_at_its_deadline() -> None:
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError):
            await in_thread(release.wait, 0.05)
    finally:
        release.set()  # the abandoned thread ends; its late result is dropped
