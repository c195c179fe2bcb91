"""The loop's inbox: what effects hand to the machine, and the tasks that hand it.

`emit` queues an event (or a reloaded file to judge); `run` starts an effect whose returned event
is queued; `spawn` starts one that emits its own. A task that fails must not leave the machine
waiting forever: the machine hears of it (`Machine.internal_error`, the exit code) and a clean
stop is queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from supervisor import log
from supervisor.core.machine import Event, StopRequested
from supervisor.daemon.reload import Read

Item = Event | Read


class Inbox:
    def __init__(self, failed: Callable[[], None] = lambda: None) -> None:
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.failed = failed
        # A failed task handed over instead of stopping (daemon.handover.Handover.recover):
        # True when a hand-over is under way.
        self.recover: Callable[[BaseException], bool] = lambda _exc: False
        self.log = log.get()

    def emit(self, item: Item) -> None:
        """The one way an effect hands an event to the loop."""
        self.queue.put_nowait(item)

    def run(self, coro: Coroutine[Any, Any, Item | None]) -> None:
        """Run an effect as a task; the event it returns is emitted."""

        async def run() -> None:
            item = await coro
            if item is not None:
                self.emit(item)

        self.spawn(run())

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            assert exc is not None
            if self.recover(exc):
                self.log.error("internal task failed; handing over", error=repr(exc))
                return
            self.failed()
            self.emit(StopRequested("internal-error"))
            self.log.error("internal task failed; stopping", error=repr(exc))
            self.log.debug("internal task traceback", exc_info=exc)
