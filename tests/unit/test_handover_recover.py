"""An internal error of the daemon's own code hands over instead of stopping SGLang: the
inbox asks `recover` first, and the hand-over is bounded (RECOVER_MAX within the window, then
the old path: a clean stop), each one recorded as an incident with the traceback."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from supervisor.core.events import StopRequested
from supervisor.daemon.handover import INTERNAL_ERROR, RECOVER_MAX, Handover
from supervisor.daemon.inbox import Inbox


async def _failing() -> None:
    raise KeyError("a field a peer never sent")


def _queued(inbox: Inbox) -> list[Any]:
    items = []
    while not inbox.queue.empty():
        items.append(inbox.queue.get_nowait())
    return items


async def _run_failing(inbox: Inbox) -> None:
    task = inbox.spawn(_failing())
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)  # the done callback


async def test_a_failed_task_that_hands_over_queues_no_stop() -> None:
    seen: list[BaseException] = []
    stopped: list[bool] = []
    inbox = Inbox(failed=lambda: stopped.append(True))
    inbox.recover = lambda exc: seen.append(exc) is None
    await _run_failing(inbox)
    assert [type(e) for e in seen] == [KeyError]
    assert _queued(inbox) == [] and stopped == []


async def test_a_failed_task_not_handed_over_stops_as_before() -> None:
    stopped: list[bool] = []
    inbox = Inbox(failed=lambda: stopped.append(True))
    inbox.recover = lambda exc: False
    await _run_failing(inbox)
    assert _queued(inbox) == [StopRequested("internal-error")] and stopped == [True]


class _Recorder:
    def __init__(self) -> None:
        self.written: list[tuple[str, str, list[str]]] = []

    def record(self, reason: str, detail: str, *rest: Any) -> str:
        self.written.append((reason, detail, list(rest[2])))
        return f"incident-{len(self.written)}"


class _Serving(Handover):
    """A serving daemon's Handover, whose exec is only counted."""

    execs = 0

    def refusal(self) -> str | None:
        return None

    def begin(self) -> None:
        self.execs += 1


def _daemon(recorder: _Recorder) -> Any:
    written: list[object] = []
    return SimpleNamespace(
        parts=SimpleNamespace(
            recorder=recorder,
            pump=SimpleNamespace(tail=lambda: ["sglang line"]),
            observed=SimpleNamespace(gpu_status=list, incident_written=written.append),
        ),
        log=SimpleNamespace(warning=lambda *a, **k: None),
    )


def test_internal_errors_hand_over_at_most_n_times_within_the_window() -> None:
    recorder = _Recorder()
    ho = _Serving(_daemon(recorder))
    try:
        raise KeyError("boom")
    except KeyError as exc:
        error = exc
    results = [ho.recover(error) for _ in range(RECOVER_MAX + 1)]
    assert results == [True] * RECOVER_MAX + [False]
    assert ho.execs == RECOVER_MAX
    # Every one an incident with the daemon's traceback, the last (not handed over) too.
    assert len(recorder.written) == RECOVER_MAX + 1
    reason, detail, tail = recorder.written[0]
    assert reason == INTERNAL_ERROR and detail == "KeyError: 'boom'"
    assert tail[0] == "sglang line"
    assert any("Traceback" in line for line in tail) and tail[-1] == "KeyError: 'boom'"
    ho.recoveries = [t - 7200 for t in ho.recoveries]  # the window has passed
    assert ho.recover(error) is True
