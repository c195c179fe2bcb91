"""Small decisions the daemon asks the machine for, pure: when and by how much systemd's job is
extended, what /readyz answers, the exit status after an internal error, whether a cleaned
follower joins the leader's epoch first, whether a reload keeps a ready server serving."""

from __future__ import annotations

import pytest

from supervisor import config
from supervisor.core.machine import (
    EXTEND_BY_S,
    Exit,
    HostNotReady,
    HostReady,
    Machine,
    Start,
    State,
    StopRequested,
    Verdict,
    extends_job,
)

SINGLE = """
sglang:
  model_path: /m
stop:
  drain_timeout: 45s
gpus:
  manage: false
"""

FOLLOWER = """
sglang:
  model_path: /m
  args: {nnodes: 2, node-rank: 1, dist-init-addr: "10.0.0.1:5000"}
group:
  peers: ["http://10.0.0.1:29400"]
"""


def machine(text: str = SINGLE, state: State = State.STARTING) -> Machine:
    m = Machine(config.parse(text, "c.yaml"), 0.0)
    m.ctx.state = state
    return m


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


def test_the_extension_is_the_start_budget_and_the_drain_budget_while_stopping() -> None:
    assert machine(state=State.LOADING).job_extension() == EXTEND_BY_S
    assert machine(state=State.STOPPING).job_extension() == EXTEND_BY_S + 45.0
    assert machine(state=State.READY).job_extension() is None
    m = machine(state=State.RESTARTING)
    m.ctx.ever_ready = True
    assert m.job_extension() is None


def test_readiness_is_the_serving_states_unless_a_worker_dies_or_the_group_says() -> None:
    assert machine(state=State.READY).ready(child_dying=False, group_ready=None)
    assert machine(state=State.DEGRADED).ready(child_dying=False, group_ready=None)
    assert not machine(state=State.WARMING).ready(child_dying=False, group_ready=None)
    assert not machine(state=State.READY).ready(child_dying=True, group_ready=True)
    assert not machine(state=State.READY).ready(child_dying=False, group_ready=False)
    assert machine(state=State.WARMING).ready(child_dying=False, group_ready=True)


def test_after_an_internal_error_every_exit_is_1() -> None:
    m = machine()
    m.handle(Start(), 0.0)
    m.internal_error()
    m.handle(HostNotReady("port busy"), 1.0)  # no exit here: nothing to override
    actions = m.handle(StopRequested("internal-error"), 2.0)
    assert [a for a in actions if isinstance(a, Exit)] == [Exit(1)]
    plain = machine()
    assert [a for a in plain.handle(StopRequested("SIGTERM"), 0.0) if isinstance(a, Exit)] == [
        Exit(0)
    ]


def test_only_a_follower_joins_after_a_clean_host_and_not_when_handing_over() -> None:
    follower = machine(FOLLOWER, State.CLEANING)
    assert follower.joins_group(HostReady())
    assert not follower.joins_group(HostNotReady("port busy"))
    follower.ctx.handing_over = True
    assert not follower.joins_group(HostReady())
    assert not machine(state=State.CLEANING).joins_group(HostReady())


def test_only_an_unchanged_reload_of_a_ready_server_keeps_it_serving() -> None:
    assert machine(state=State.READY).stays_ready(Verdict.UNCHANGED)
    assert not machine(state=State.READY).stays_ready(Verdict.CHANGED)
    assert not machine(state=State.DEGRADED).stays_ready(Verdict.UNCHANGED)
