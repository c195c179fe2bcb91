"""The machine's GPU fitness decisions: an unfit GPU before a launch, a GPU fault while serving.

Edges these events take, each pinned with its actions (the same style as test_machine's edge
table): CLEANING -> FAILED on GpuUnfit; every child state -> RESTARTING on a GpuFault that
needs a restart; a GpuFault that needs none is a same-state report and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from supervisor.core.machine import (
    CHILD_STATES,
    EDGES,
    ChildGone,
    GpuFault,
    GpuUnfit,
    HostReady,
    Reason,
    RecordRestart,
    SetTimer,
    State,
    StopChild,
    TimerFired,
    TimerName,
    Transitioned,
)
from testkit.machine import LAUNCH_TIMERS, Drive, check_edge, edge_ids, make_cfg, of, transitions

LINE = (
    "GPU 3 (GPU-51a11a7e-0000-4000-8000-000000000003) needs a reset: "
    "row remapping pending (applied at the next GPU reset)"
)
LOST = "GPU 1 (GPU-51a11a7e-0000-4000-8000-000000000001) needs a reboot: the GPU is lost"


def _cleaning_failed_unfit() -> Any:
    d = Drive().cleaning()
    return d.send(GpuUnfit(LINE)), [Transitioned(State.CLEANING, State.FAILED, "gpu_unfit", LINE)]


def _fault_restart(path: Callable[[Drive], Drive], state: State) -> Callable[[], Any]:
    def case() -> Any:
        d = path(Drive())
        return d.send(GpuFault(LOST, restart=True)), [
            Transitioned(state, State.RESTARTING, "gpu_fault", LOST),
            *LAUNCH_TIMERS,
            StopChild(1, graceful=False),
        ]

    return case


EDGE_CASES: dict[tuple[State, State], Callable[[], Any]] = {
    (State.CLEANING, State.FAILED): _cleaning_failed_unfit,
    (State.LAUNCHING, State.RESTARTING): _fault_restart(Drive.launching, State.LAUNCHING),
    (State.LOADING, State.RESTARTING): _fault_restart(Drive.loading, State.LOADING),
    (State.WARMING, State.RESTARTING): _fault_restart(Drive.warming, State.WARMING),
    (State.READY, State.RESTARTING): _fault_restart(Drive.ready, State.READY),
    (State.DEGRADED, State.RESTARTING): _fault_restart(Drive.degraded, State.DEGRADED),
    (State.DRAINING, State.RESTARTING): _fault_restart(Drive.draining, State.DRAINING),
}


def test_every_fitness_edge_is_in_the_table() -> None:
    assert all(new in EDGES[old] for old, new in EDGE_CASES)
    # Every state a child can run in reacts to a GPU that needs a restart.
    assert {old for old, new in EDGE_CASES if new is State.RESTARTING} == set(CHILD_STATES)


@pytest.mark.parametrize("edge", list(EDGE_CASES), ids=edge_ids(EDGE_CASES))
def test_edge(edge: tuple[State, State]) -> None:
    check_edge(EDGE_CASES, edge)


def test_unfit_gpu_is_never_relaunched_until_an_operator_acts() -> None:
    d = Drive().cleaning()
    d.send(GpuUnfit(LINE))
    assert d.m.ctx.host_message == LINE
    # Nothing but a reload or a manual restart leaves failed: no timer, no HostReady.
    assert d.send(HostReady()) == []
    assert d.send(TimerFired(TimerName.CLEAN_RETRY, d.launch), after=600) == []
    assert d.send(TimerFired(TimerName.BACKOFF, d.launch), after=600) == []
    d.expect(State.FAILED)


def test_unfit_outside_cleaning_is_ignored() -> None:
    d = Drive().ready()
    assert d.send(GpuUnfit(LINE)) == []
    d.expect(State.READY)


@pytest.mark.parametrize("path", [Drive.ready, Drive.degraded, Drive.loading, Drive.warming])
def test_fault_the_driver_asks_nothing_for_is_reported_and_serving_goes_on(
    path: Callable[[Drive], Drive],
) -> None:
    d = path(Drive())
    before = d.state
    got = d.send(GpuFault(LINE, restart=False))
    assert got == [Transitioned(before, before, "gpu_fault", LINE)]
    assert d.state is before
    assert d.m.ctx.child


@pytest.mark.parametrize("path", [Drive.cleaning, Drive.backing_off, Drive.failed])
def test_fault_without_a_child_is_only_reported(path: Callable[[Drive], Drive]) -> None:
    d = path(Drive())
    before = d.state
    assert d.send(GpuFault(LOST, restart=True)) == [Transitioned(before, before, "gpu_fault", LOST)]
    assert d.state is before


@pytest.mark.parametrize("path", [Drive.stopping, Drive.stopped])
def test_fault_while_stopping_does_nothing(path: Callable[[Drive], Drive]) -> None:
    d = path(Drive())
    assert d.send(GpuFault(LOST, restart=True)) == []


def test_fault_restart_is_recorded_backs_off_and_counts_towards_a_crash_loop() -> None:
    d = Drive(make_cfg(fallback=None, max_restarts=2)).ready()
    d.send(GpuFault(LOST, restart=True), after=1)
    got = d.send(ChildGone(d.launch, None, 9), after=0.5)
    assert of(RecordRestart, got) == [RecordRestart(Reason.GPU_FAULT, None, 9, LOST)]
    assert [a.name for a in of(SetTimer, got)] == [TimerName.BACKOFF]
    # Back in cleaning, fitness is read again: still unfit -> failed, no further launch.
    d.backoff_elapsed(after=5)
    assert transitions(d.send(GpuUnfit(LOST))) == [(State.CLEANING, State.FAILED)]


def test_a_second_fault_while_restarting_does_not_restart_twice() -> None:
    d = Drive().ready()
    d.send(GpuFault(LOST, restart=True))
    got = d.send(GpuFault(LOST, restart=True))
    assert got == [Transitioned(State.RESTARTING, State.RESTARTING, "gpu_fault", LOST)]
    assert of(StopChild, got) == []
