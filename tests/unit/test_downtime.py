"""Downtime per unrequested restart: from leaving ready to ready again."""

from __future__ import annotations

import pytest

from supervisor.core.downtime import Downtime
from supervisor.core.machine import Reason, State, Transitioned

R, D, RS, C, L, W, DR, ST = (
    State.READY,
    State.DEGRADED,
    State.RESTARTING,
    State.CLEANING,
    State.LAUNCHING,
    State.WARMING,
    State.DRAINING,
    State.STOPPING,
)


def run(steps: list[tuple[State, State, str, float]]) -> list[float]:
    d = Downtime()
    out = []
    for old, new, reason, now in steps:
        got = d.transitioned(Transitioned(old, new, reason), now)
        if got is not None:
            out.append(got)
    return out


def _relaunch(
    start: float, reason: str = Reason.EXITED.value
) -> list[tuple[State, State, str, float]]:
    return [
        (R, RS, reason, start),
        (RS, C, "backoff", start + 5),
        (C, L, "host ready", start + 6),
        (L, State.LOADING, "launched", start + 7),
        (State.LOADING, W, "port open", start + 30),
        (W, R, "probe_ok", start + 31),
    ]


def test_a_crash_is_measured_from_leaving_ready() -> None:
    assert run(_relaunch(100.0)) == [31.0]


@pytest.mark.parametrize("reason", [Reason.MANUAL.value, Reason.RELOAD.value])
def test_a_requested_restart_is_not(reason: str) -> None:
    assert run(_relaunch(100.0, reason)) == []


def test_degraded_then_restarted_counts_from_leaving_ready() -> None:
    steps = [(R, D, "liveness", 50.0), *_relaunch(60.0, Reason.LIVENESS_FAILED.value)[1:]]
    steps.insert(1, (D, RS, Reason.LIVENESS_FAILED.value, 60.0))
    assert run(steps) == [41.0]


def test_degraded_and_back_is_no_restart() -> None:
    assert run([(R, D, "liveness", 1.0), (D, R, "liveness ok", 3.0)]) == []


def test_a_crash_loop_before_ready_again_is_one_downtime() -> None:
    steps = [
        *_relaunch(0.0)[:4],
        (State.LOADING, RS, Reason.EXITED.value, 20.0),
        (RS, C, "backoff", 30.0),
        (C, L, "host ready", 31.0),
        (L, State.LOADING, "launched", 32.0),
        (State.LOADING, W, "port open", 50.0),
        (W, R, "probe_ok", 52.0),
    ]
    assert run(steps) == [52.0]


def test_a_manual_restart_in_the_middle_is_not_counted() -> None:
    steps = [*_relaunch(0.0)[:4], (State.LOADING, RS, Reason.MANUAL.value, 10.0)]
    steps += _relaunch(0.0)[1:]
    assert run(steps) == []


def test_drained_or_stopped_starts_nothing() -> None:
    assert (
        run([(R, DR, "drain", 1.0), (DR, RS, Reason.EXITED.value, 2.0), *_relaunch(2.0)[1:]]) == []
    )
    assert run([(R, RS, Reason.EXITED.value, 1.0), (RS, ST, "SIGTERM", 2.0)]) == []


def test_two_crashes_are_two_downtimes() -> None:
    assert run(_relaunch(0.0) + _relaunch(100.0)) == [31.0, 31.0]
