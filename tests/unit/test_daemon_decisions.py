"""Small decisions of the daemon that are pure: when systemd's job is extended."""

from __future__ import annotations

import pytest

from supervisor.core.machine import State, extends_job


@pytest.mark.parametrize(
    "state",
    [
        State.STARTING,
        State.CLEANING,
        State.LAUNCHING,
        State.LOADING,
        State.WARMING,
        State.RESTARTING,
    ],
)
def test_the_start_job_is_extended_through_a_crash_loop_until_the_first_ready(
    state: State,
) -> None:
    # A backoff between two failed loads is still part of the first start: without the
    # extension systemd times the start out before the fallback profile is tried.
    assert extends_job(state, ever_ready=False)
    assert not extends_job(state, ever_ready=True)


@pytest.mark.parametrize("state", [State.READY, State.DEGRADED, State.FAILED, State.STOPPED])
def test_no_extension_outside_a_job(state: State) -> None:
    assert not extends_job(state, ever_ready=False)
    assert not extends_job(state, ever_ready=True)


def test_the_stop_job_is_extended() -> None:
    assert extends_job(State.STOPPING, ever_ready=True)
    assert extends_job(State.STOPPING, ever_ready=False)
