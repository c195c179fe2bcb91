"""The one adapter between the event loop and blocking calls (file systems, NVML).

Not asyncio.to_thread: a call stuck on a hung NFS mount or in a hung GPU driver would keep its
pool thread, and asyncio.run() waits for the pool at exit, so the daemon could never stop. A
daemon thread is simply abandoned when its deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def in_thread(fn: Callable[[], T], timeout: float) -> T:
    """Run blocking `fn` in a daemon thread; TimeoutError after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not done.done():
            outcome()

    def deliver(outcome: Callable[[], None]) -> None:
        # The loop may be gone by now (an abandoned call finishing after exit): drop it.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, outcome)

    def work() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            error = exc  # `exc` is unbound after the except block; the callback runs later
            deliver(lambda: done.set_exception(error))
        else:
            deliver(lambda: done.set_result(result))

    threading.Thread(target=work, name="kimi-serve-io", daemon=True).start()
    async with asyncio.timeout(timeout):
        return await done
