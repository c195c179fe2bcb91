"""The router decisions of the machine: register on entering READY, deregister on leaving it
and ahead of every stop of SGLang, and the DRAINING state. Pure: an explicit clock, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.config import Config, RouterConfig
from supervisor.core.machine import (
    SERVING,
    Action,
    ChildExited,
    ChildGone,
    DrainRequested,
    Event,
    FatalLog,
    HostReady,
    Launched,
    Machine,
    PortOpen,
    ProbeDone,
    ProbeKind,
    Reason,
    RestartRequested,
    RouterDeregister,
    RouterRegister,
    State,
    StopChild,
    StopRequested,
    TimerFired,
    TimerName,
    Transitioned,
    UndrainRequested,
)
from testkit.machine import CFG, SCHEDULER_EXCEPTION, Drive, failed_result, make_cfg, ok_result
from testkit.machine_runs import CONFIGS, SETTINGS, Invariants, daemon_like_run

ROUTER = RouterConfig(url="http://10.0.0.5:30080", worker_url="http://10.0.0.7:30000")


def routed(cfg: Config = CFG) -> Config:
    return replace(cfg, router=ROUTER)


RCFG = routed()


def router_actions(actions: list[Action]) -> list[Action]:
    return [a for a in actions if isinstance(a, RouterRegister | RouterDeregister)]


def before_stop(actions: list[Action]) -> Action:
    i = next(i for i, a in enumerate(actions) if isinstance(a, StopChild))
    return actions[i - 1]


# --------------------------------------------------------------------- edge table (router on)

# Each case: how to get there, the event, the router actions expected (in order).
CASES: dict[str, tuple[Any, Any, list[Action]]] = {
    "warming->ready registers": (
        Drive.warming,
        lambda d: d.send(ProbeDone(d.launch, ProbeKind.READINESS, ok_result())),
        [RouterRegister(1)],
    ),
    "ready->degraded deregisters without waiting": (
        Drive.ready,
        lambda d: d.liveness(failed_result()),
        [RouterDeregister(1, "degraded", wait_idle=False)],
    ),
    "degraded->ready registers again": (
        Drive.degraded,
        lambda d: d.liveness(ok_result()),
        [RouterRegister(1)],
    ),
    "degraded stays degraded: nothing": (
        Drive.degraded,
        lambda d: d.liveness(failed_result()),
        [],
    ),
    "ready->draining deregisters and waits": (
        Drive.ready,
        lambda d: d.send(DrainRequested()),
        [RouterDeregister(1, "draining", wait_idle=True)],
    ),
    "degraded->draining waits for idle": (
        Drive.degraded,
        lambda d: d.send(DrainRequested()),
        [RouterDeregister(1, "drain", wait_idle=True)],
    ),
    "draining->ready registers": (
        Drive.draining,
        lambda d: d.send(UndrainRequested()),
        [RouterRegister(1)],
    ),
    "draining: liveness ok registers nothing": (
        Drive.draining,
        lambda d: d.liveness(ok_result()),
        [],
    ),
    "ready->restarting (exited): deregister, no wait": (
        Drive.ready,
        lambda d: d.send(ChildExited(1, None, 9)),
        [RouterDeregister(1, "exited", wait_idle=False)],
    ),
    "ready->restarting (manual): deregister and wait": (
        Drive.ready,
        lambda d: d.send(RestartRequested(Reason.MANUAL)),
        [RouterDeregister(1, "manual", wait_idle=True)],
    ),
    "ready->restarting (reload): deregister and wait": (
        Drive.ready,
        lambda d: d.send(RestartRequested(Reason.RELOAD)),
        [RouterDeregister(1, "reload", wait_idle=True)],
    ),
    "degraded->restarting (fatal line)": (
        Drive.degraded,
        lambda d: d.send(FatalLog(1, SCHEDULER_EXCEPTION)),
        [RouterDeregister(1, "fatal_log", wait_idle=False)],
    ),
    "draining->restarting (manual) waits": (
        Drive.draining,
        lambda d: d.send(RestartRequested(Reason.MANUAL)),
        [RouterDeregister(1, "manual", wait_idle=True)],
    ),
    "ready->stopping: deregister and wait": (
        Drive.ready,
        lambda d: d.send(StopRequested()),
        [RouterDeregister(1, "stop", wait_idle=True)],
    ),
    "draining->stopping": (
        Drive.draining,
        lambda d: d.send(StopRequested()),
        [RouterDeregister(1, "stop", wait_idle=True)],
    ),
    "loading->restarting (load timeout): deregister anyway, no wait": (
        Drive.loading,
        lambda d: d.send(TimerFired(TimerName.LOAD, 1), after=3600),
        [RouterDeregister(1, "load_timeout", wait_idle=False)],
    ),
    "stopping: a second SIGTERM kills at once, no new deregistration": (
        Drive.stopping,
        lambda d: d.send(StopRequested()),
        [],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_router_actions(name: str) -> None:
    path, event, expected = CASES[name]
    d = path(Drive(RCFG))
    actions = event(d)
    assert router_actions(actions) == expected
    if any(isinstance(a, StopChild) for a in actions) and expected:
        assert before_stop(actions) == expected[-1], "the deregistration must precede the stop"
    register = [i for i, a in enumerate(actions) if isinstance(a, RouterRegister)]
    for i in register:
        assert isinstance(actions[i - 1], Transitioned) and actions[i - 1].new is State.READY


@pytest.mark.parametrize("name", list(CASES))
def test_no_router_actions_without_router_url(name: str) -> None:
    path, event, _ = CASES[name]
    assert router_actions(event(path(Drive(CFG)))) == []


# --------------------------------------------------------------------- drain / undrain rules


def test_drain_only_while_serving() -> None:
    for path in (Drive.cleaning, Drive.loading, Drive.warming, Drive.backing_off, Drive.failed):
        d = path(Drive(RCFG))
        assert d.m.drain_refusal() is not None
        assert "not serving" in (d.m.drain_refusal() or "")
        assert d.send(DrainRequested()) == []
    d = Drive(RCFG).ready()
    assert d.m.drain_refusal() is None and d.m.undrain_refusal() is not None
    assert d.send(UndrainRequested()) == []


def test_drain_twice_is_one_drain() -> None:
    d = Drive(RCFG).draining()
    assert d.m.drain_refusal() is None
    assert d.send(DrainRequested()) == []
    assert d.state is State.DRAINING


def test_draining_is_still_liveness_probed_and_restarts_on_threshold() -> None:
    d = Drive(RCFG).draining()
    actions = d.send(TimerFired(TimerName.LIVENESS, 1), after=15)
    assert any(type(a).__name__ == "StartProbe" for a in actions)
    d.liveness(failed_result(), after=0)
    assert d.state is State.DRAINING  # a status update, no DEGRADED: it is out already
    d.send(TimerFired(TimerName.LIVENESS, 1), after=15)
    d.liveness(failed_result(), after=0)
    d.send(TimerFired(TimerName.LIVENESS, 1), after=15)
    actions = d.liveness(failed_result(), after=0)
    assert d.state is State.RESTARTING
    assert router_actions(actions) == [RouterDeregister(1, "liveness_failed", wait_idle=False)]


def test_draining_is_not_ready_for_readyz() -> None:
    assert State.DRAINING not in SERVING


def test_a_restart_ends_draining_and_the_next_ready_registers() -> None:
    d = Drive(RCFG).draining()
    d.send(RestartRequested(Reason.MANUAL))
    d.send(ChildGone(1, 0, None))
    assert d.state is State.CLEANING
    d.send(HostReady())
    d.send(Launched(2, 99))
    d.send(PortOpen(2))
    actions = d.send(ProbeDone(2, ProbeKind.READINESS, ok_result()))
    assert d.state is State.READY and router_actions(actions) == [RouterRegister(2)]


# --------------------------------------------------------------------- the property


@dataclass
class RouterInvariants(Invariants):
    """Also: registration wanted only in READY, and every stop comes after a deregistration."""

    wanted: bool = False

    def handle(self, event: Event, now: float) -> list[Action]:
        before = self.m.state
        actions = super().handle(event, now)
        for i, a in enumerate(actions):
            if isinstance(a, RouterRegister):
                prev = actions[i - 1]
                assert isinstance(prev, Transitioned) and prev.new is State.READY, actions
                assert a.launch == self.m.ctx.launch
                self.wanted = True
            elif isinstance(a, RouterDeregister):
                self.wanted = False
            elif isinstance(a, StopChild) and before is not State.STOPPING:
                prev = actions[i - 1]
                assert isinstance(prev, RouterDeregister) and prev.launch == a.launch, actions
        if self.wanted:
            assert self.m.state is State.READY, f"registration wanted in {self.m.state}"
        return actions


@settings(SETTINGS, max_examples=60)
@given(data=st.data(), cfg=st.sampled_from([routed(c) for c in CONFIGS]), steps=st.integers(1, 120))
def testdaemon_like_runs_keep_the_router_invariants(data: Any, cfg: Config, steps: int) -> None:
    world = daemon_like_run(data, cfg, steps, RouterInvariants)
    assert isinstance(world.inv, RouterInvariants)
    assert not world.inv.wanted  # after the final stop


def test_make_cfg_has_no_router() -> None:
    assert not make_cfg().router.enabled and Machine(RCFG, 0).cfg.router.enabled
