"""The supervision machine driven by hand: an explicit clock, scripted paths to each state.

- `Drive(cfg, now)`: a `Machine` and its clock; `d.ready()`, `d.crash()`, ... walk it to a state
  and assert that it landed there; `send(event, after)` advances the clock.
- `make_cfg(**over)`, `CFG`: a validated config (a fallback profile, fast timings);
  `with_canary(cfg, policy="alert")`: the same with other quality.canary settings.
- `ok_result`, `failed_result`, `not_up_result`, `ZERO_TOKENS`: probe results.
- `transitions`, `of`, `backoff_delays`, `events`: what a list of actions holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from supervisor import config
from supervisor.config import Config
from supervisor.core import machine as core
from supervisor.sglang.probe import ProbeResult

T0 = 1_000.0
PID = 4242
FALLBACK = "fallback"
SCHEDULER_EXCEPTION = config.DEFAULT_FATAL_PATTERNS[0]


def make_cfg(
    *,
    fallback: str | None = FALLBACK,
    max_restarts: int = 3,
    window: str = "1h",
    backoff_initial: str = "5s",
    backoff_max: str = "5m",
    threshold: int = 3,
    stable_after: str = "10m",
    mode: str = "relaunch",
) -> Config:
    text = f"""
sglang:
  model_path: /shared/kimi-k2.5-int4
  args:
    tp-size: 8
    speculative-algorithm: EAGLE3
profiles:
  {FALLBACK}:
    args:
      speculative-algorithm: null
readiness:
  load_timeout: 30m
  probe:
    max_tokens: 8
    timeout: 30s
liveness:
  interval: 15s
  timeout: 20s
  failure_threshold: {threshold}
restart:
  backoff_initial: {backoff_initial}
  backoff_max: {backoff_max}
  crash_loop:
    max_restarts: {max_restarts}
    window: {window}
  fallback_profile: {"null" if fallback is None else fallback}
  stable_after: {stable_after}
  mode: {mode}
gpus:
  manage: false
"""
    return config.parse(text, "test.yaml")


CFG = make_cfg()


def with_canary(cfg: Config = CFG, **canary: Any) -> Config:
    """`cfg` with quality.canary's fields replaced (policy="alert", enabled=False)."""
    quality = dataclasses.replace(
        cfg.quality, canary=dataclasses.replace(cfg.quality.canary, **canary)
    )
    return dataclasses.replace(cfg, quality=quality)


def ok_result(tokens: int = 8) -> ProbeResult:
    return ProbeResult(
        True, "ok", None, 0.42, completion_tokens=tokens, spec_verify_ct=3, text="Hello!"
    )


def failed_result(
    reason: str = "timeout", error: str | None = "no answer within 20s"
) -> ProbeResult:
    return ProbeResult(False, reason, error, 20.0)


def not_up_result() -> ProbeResult:
    return ProbeResult(False, "connect", "cannot connect: refused", 0.001, not_up=True)


ZERO_TOKENS = failed_result("too_few_tokens", "generated 0 of 8 tokens (finish_reason 'stop')")
LAUNCH_TIMERS = [
    core.CancelTimer(core.TimerName.LOAD),
    core.CancelTimer(core.TimerName.LIVENESS),
    core.CancelTimer(core.TimerName.PROBE_RETRY),
]
ALL_TIMERS = [core.CancelTimer(n) for n in core.TimerName]


class Drive:
    """A Machine, an explicit clock, and the scripted paths to each state."""

    def __init__(self, cfg: Config = CFG, now: float = T0) -> None:
        self.cfg = cfg
        self.now = now
        self.m = core.Machine(cfg, now)

    @property
    def state(self) -> core.State:
        return self.m.state

    @property
    def launch(self) -> int:
        return self.m.ctx.launch

    def send(self, event: core.Event, after: float = 0.0) -> list[core.Action]:
        self.now += after
        return self.m.handle(event, self.now)

    def expect(self, state: core.State) -> Drive:
        assert self.state is state, f"expected {state}, machine is in {self.state}"
        return self

    # Paths. Each asserts where it lands, so a broken step fails where it breaks.
    def cleaning(self) -> Drive:
        self.send(core.Start())
        return self.expect(core.State.CLEANING)

    def waiting(self) -> Drive:
        self.cleaning().send(core.HostNotReady("model_path missing", model_missing=True))
        return self.expect(core.State.WAITING)

    def launching(self) -> Drive:
        self.cleaning().send(core.HostReady())
        return self.expect(core.State.LAUNCHING)

    def loading(self) -> Drive:
        self.launching().send(core.Launched(self.launch, PID), after=0.1)
        return self.expect(core.State.LOADING)

    def warming(self) -> Drive:
        self.loading().send(core.PortOpen(self.launch), after=600)
        return self.expect(core.State.WARMING)

    def ready(self) -> Drive:
        self.warming().send(
            core.ProbeDone(self.launch, core.ProbeKind.READINESS, ok_result()), after=1
        )
        return self.expect(core.State.READY)

    def degraded(self) -> Drive:
        self.ready().liveness(failed_result())
        return self.expect(core.State.DEGRADED)

    def draining(self) -> Drive:
        self.ready().send(core.DrainRequested(), after=1)
        return self.expect(core.State.DRAINING)

    def restarting(self) -> Drive:
        """Restarting with the old child still being stopped."""
        self.ready().send(core.ChildExited(self.launch, None, 9), after=5)
        return self.expect(core.State.RESTARTING)

    def backing_off(self) -> Drive:
        """Restarting with the child gone: the backoff timer runs."""
        self.restarting().send(core.ChildGone(self.launch, None, 9), after=1)
        assert not self.m.ctx.child
        return self.expect(core.State.RESTARTING)

    def failed(self) -> Drive:
        self.cleaning().send(
            core.HostNotReady("process 77 survives SIGKILL (D state)", wedged=True)
        )
        return self.expect(core.State.FAILED)

    def stopping(self) -> Drive:
        self.ready().send(core.StopRequested())
        return self.expect(core.State.STOPPING)

    def stopped(self) -> Drive:
        self.stopping().send(core.ChildGone(self.launch, 0, None), after=3)
        return self.expect(core.State.STOPPED)

    # Steps used by several tests.
    def liveness(
        self, result: ProbeResult, busy: bool = False, after: float = 15
    ) -> list[core.Action]:
        return self.send(
            core.ProbeDone(self.launch, core.ProbeKind.LIVENESS, result, busy), after=after
        )

    def bring_up(self, after: float = 0.0) -> list[core.Action]:
        """From CLEANING to READY; returns the actions of the Launch step."""
        self.expect(core.State.CLEANING)
        actions = self.send(core.HostReady(), after=after)
        self.send(core.Launched(self.launch, PID), after=0.1)
        self.send(core.PortOpen(self.launch), after=60)
        self.send(core.ProbeDone(self.launch, core.ProbeKind.READINESS, ok_result()), after=1)
        self.expect(core.State.READY)
        return actions

    def crash(self, after: float = 1.0) -> list[core.Action]:
        """SGLang dies in a child state (its whole group at once, as a SIGKILL of the group
        leaves it); returns the actions on ChildGone."""
        assert self.state in core.CHILD_STATES
        self.send(core.ChildExited(self.launch, None, 9), after=after)
        self.expect(core.State.RESTARTING)
        return self.send(core.ChildGone(self.launch, None, 9))

    def backoff_elapsed(self, after: float = 1.0) -> list[core.Action]:
        actions = self.send(core.TimerFired(core.TimerName.BACKOFF, self.launch), after=after)
        self.expect(core.State.CLEANING)
        return actions


def edge_ids(cases: Mapping[tuple[core.State, core.State], object]) -> list[str]:
    """Test ids for a table of edge cases: `old->new`."""
    return [f"{a.value}->{b.value}" for a, b in cases]


def check_edge(
    cases: Mapping[tuple[core.State, core.State], Callable[[], Any]],
    edge: tuple[core.State, core.State],
) -> None:
    """The case's actions take `edge` first and are exactly the ones it expects."""
    got, expected = cases[edge]()
    assert transitions(got)[0] == edge
    assert got == expected


def events(*items: core.Event) -> tuple[core.Event, ...]:
    return items


def transitions(actions: list[core.Action]) -> list[tuple[core.State, core.State]]:
    return [(a.old, a.new) for a in actions if isinstance(a, core.Transitioned)]


def of(kind: type, actions: list[core.Action]) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def backoff_delays(actions: list[core.Action]) -> list[float]:
    return [
        a.delay
        for a in actions
        if isinstance(a, core.SetTimer) and a.name is core.TimerName.BACKOFF
    ]
