"""Daemon-like runs of the machine: the daemon's side played against it, invariants checked.

`daemon_like_run(data, cfg, steps)` drives a `World` (a FIFO event queue plus effects in
flight, as the daemon has them) with hypothesis's `data`, and `Invariants` checks after every
event: no illegal edge, never ready without a decode probe of the current launch, never two
launches at once, never stuck. `CONFIGS`, `RESULTS`, `SETTINGS`: what the property tests draw.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from supervisor.config import Config
from supervisor.core import machine as core
from testkit.machine import (
    PID,
    SCHEDULER_EXCEPTION,
    T0,
    ZERO_TOKENS,
    failed_result,
    make_cfg,
    not_up_result,
    ok_result,
)


@dataclass
class Invariants:
    """Wraps a Machine; checks every handled event against the rules that must always hold."""

    m: core.Machine
    ready_evidence: bool = False  # a readiness probe of the current launch succeeded
    launches: int = 0
    exits: int = 0
    owed_record: bool = False  # entered RESTARTING; RecordRestart must come before leaving
    edges: set[tuple[core.State, core.State]] = field(default_factory=set)

    def handle(self, event: core.Event, now: float) -> list[core.Action]:
        m = self.m
        before, launch, child, profile = m.state, m.ctx.launch, m.ctx.child, m.ctx.profile
        actions = m.handle(event, now)
        good_probe = (
            isinstance(event, core.ProbeDone)
            and event.kind is core.ProbeKind.READINESS
            and event.result.ok
            and event.launch == launch
        )
        self._check(event, before, child, profile, good_probe, actions)
        return actions

    def _check(
        self,
        event: core.Event,
        before: core.State,
        child_before: bool,
        profile: str,
        good_probe: bool,
        actions: list[core.Action],
    ) -> None:
        m, cfg = self.m, self.m.cfg
        if before is core.State.STOPPED:
            assert actions == [], "STOPPED is final"
        if before is core.State.FAILED and not isinstance(
            event, core.RestartRequested | core.StopRequested
        ):
            assert actions == [], f"FAILED acted on {event}"
        if before in (core.State.STOPPING, core.State.STOPPED):
            for a in actions:
                assert (
                    a == core.StopChild(m.ctx.launch, graceful=False)
                    or a
                    == core.Transitioned(core.State.STOPPING, core.State.STOPPED, "child_stopped")
                    or a == core.Exit(0)
                    # restart.mode: exit, handing over: the cleaning's answer ends it.
                    or (
                        cfg.restart.mode == "exit"
                        and isinstance(event, core.HostReady | core.HostNotReady)
                        and (
                            a == core.Exit(core.EX_RESTART_BY_ORCHESTRATOR)
                            or (
                                isinstance(a, core.Transitioned)
                                and (a.old, a.new, a.reason)
                                == (core.State.STOPPING, core.State.STOPPED, "restart_mode_exit")
                            )
                        )
                    )
                ), f"{a} while stopping"
        if good_probe:
            self.ready_evidence = True
        state = before
        became_ready = False
        for a in actions:
            match a:
                case core.Transitioned():
                    assert a.old is state, f"{a} does not start from {state}"
                    status_only = a.old is a.new and a.old in (
                        core.State.CLEANING,
                        core.State.WAITING,
                        core.State.DEGRADED,
                        core.State.RESTARTING,
                        core.State.DRAINING,
                    )
                    assert status_only or a.new in core.EDGES[a.old], f"illegal edge {a}"
                    if a.old is core.State.WARMING and a.new is core.State.READY:
                        assert good_probe, f"ready on {event}, not on a readiness probe"
                        became_ready = True
                    if a.new is core.State.RESTARTING:
                        self.owed_record = True
                    if a.old is core.State.RESTARTING and a.new in (
                        core.State.CLEANING,
                        core.State.FAILED,
                    ):
                        assert not self.owed_record, "left RESTARTING without RecordRestart"
                    if a.new is core.State.STOPPING:
                        self.owed_record = False
                    self.edges.add((a.old, a.new))
                    state = a.new
                case core.Launch():
                    assert not child_before, "Launch while a child of the machine exists"
                    assert a.launch == self.launches + 1
                    assert a.profile == profile
                    self.launches = a.launch
                    self.ready_evidence = False
                case core.RecordRestart():
                    assert self.owed_record or before is core.State.FAILED, f"extra {a}"
                    self.owed_record = False
                case core.NotifyReady():
                    assert became_ready
                case core.Exit():
                    handed_over = cfg.restart.mode == "exit" and isinstance(
                        event, core.HostReady | core.HostNotReady
                    )
                    assert a.code == (core.EX_RESTART_BY_ORCHESTRATOR if handed_over else 0)
                    self.exits += 1
                    assert self.exits == 1, "Exit twice"
                case core.StopChild():
                    assert a.launch == m.ctx.launch and m.ctx.child
                case core.SetTimer():
                    assert a.launch == m.ctx.launch and a.delay >= 0
                    if a.name is core.TimerName.LOAD:
                        assert a.delay == cfg.readiness.load_timeout
                    elif a.name is core.TimerName.LIVENESS:
                        assert a.delay == cfg.liveness.interval
                    elif a.name is core.TimerName.PROBE_RETRY:
                        assert a.delay == core.PROBE_RETRY_DELAY
                    else:
                        assert a.delay <= cfg.restart.backoff_max
                case core.ProfileChanged():
                    assert a.old == profile and a.new != a.old
                    profile = a.new
                case _:
                    pass
        assert m.state is state
        assert m.ctx.profile == profile and profile in cfg.profile_names
        if m.state in core.SERVING:
            assert self.ready_evidence, "serving without a good readiness probe of this launch"
        if m.state in core.CHILD_STATES:
            assert m.ctx.child, f"{m.state} without a child"
        if m.state in (
            core.State.STARTING,
            core.State.CLEANING,
            core.State.FAILED,
            core.State.STOPPED,
        ):
            assert not m.ctx.child, f"{m.state} with a child"
        if m.state is core.State.STOPPED:
            assert self.exits == 1


CONFIGS = [
    make_cfg(max_restarts=2, threshold=2),
    make_cfg(max_restarts=3, fallback=None, threshold=1),
    make_cfg(max_restarts=2, backoff_initial="0s", backoff_max="1s", window="30s"),
    make_cfg(max_restarts=2, threshold=2, mode="exit"),
]
RESULTS = st.sampled_from(
    [
        *[ok_result()] * 4,
        not_up_result(),
        failed_result(),
        ZERO_TOKENS,
        failed_result("no_speculation", "spec_verify_ct is 0"),
        failed_result("connection_lost", "Server disconnected"),
    ]
)
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class World:
    """The daemon as the machine sees it: a FIFO queue plus effects that finish later.

    It follows daemon.py: a spawn answers Launched or LaunchFailed at once; StopChild for a
    launch with no process answers ChildGone at once, and while a stop runs a second one is
    only an escalation; a timer that fired sits in the queue even if cancelled afterwards.
    """

    inv: Invariants
    data: Any
    now: float = T0
    queue: deque[core.Event] = field(default_factory=deque)
    timers: dict[core.TimerName, tuple[core.TimerFired, float]] = field(default_factory=dict)
    cleans: int = 0
    probes: list[tuple[int, core.ProbeKind]] = field(default_factory=list)
    stopping: int | None = None
    alive: set[int] = field(default_factory=set)
    spawned: int | None = None  # the daemon's `self.child`: the last successful spawn
    told: set[tuple[str, int]] = field(default_factory=set)

    @classmethod
    def started(cls, inv: Invariants, data: Any) -> World:
        world = cls(inv, data)
        # The signal handlers are installed before the daemon queues Start(), so a SIGTERM
        # during its preflight checks lands first.
        if data.draw(st.integers(0, 49)) == 0:
            world.queue.append(core.StopRequested())
        world.queue.append(core.Start())
        return world

    @property
    def m(self) -> core.Machine:
        return self.inv.m

    def draw(self, strategy: st.SearchStrategy[Any]) -> Any:
        return self.data.draw(strategy)

    def deliver(self) -> None:
        event = self.queue.popleft()
        for a in self.inv.handle(event, self.now):
            self.perform(a)
        # Never forget a live process: a leak survives the daemon.
        assert not self.alive or (self.m.ctx.child and self.alive == {self.m.ctx.launch})

    def perform(self, a: core.Action) -> None:
        match a:
            case core.CleanHost():
                self.cleans += 1
            case core.Launch():
                assert not self.alive, "two SGLang launches at once"
                if self.draw(st.integers(0, 9)) != 5:  # one spawn in ten fails
                    self.alive.add(a.launch)
                    self.spawned = a.launch
                    self.queue.append(core.Launched(a.launch, PID + a.launch))
                else:
                    self.queue.append(core.LaunchFailed(a.launch, "cannot start python"))
            case core.StartProbe():
                self.probes.append((a.launch, a.kind))
            case core.StopChild():
                if self.spawned != a.launch:
                    self.queue.append(core.ChildGone(a.launch, None, None))
                elif self.stopping is None:
                    self.stopping = a.launch
            case core.SetTimer():
                self.timers[a.name] = (core.TimerFired(a.name, a.launch), self.now + a.delay)
            case core.CancelTimer():
                self.timers.pop(a.name, None)
            case _:
                pass

    def moves(self) -> list[str]:
        """What may happen next, weighted: effects finish often, SGLang dies and operators act
        rarely (else a run seldom gets as far as a liveness probe)."""
        moves = ["clean"] * 30 * bool(self.cleans) + ["probe"] * 30 * bool(self.probes)
        moves += ["stop_done"] * 30 * (self.stopping is not None)
        # Cleaning, a probe (30 s at most) and a stop finish before the next timer is due.
        moves += ["timer"] * 10 * bool(self.timers and not moves)
        moves += ["deliver"] * 60 * bool(self.queue)
        cur = self.spawned
        if cur is not None and cur in self.alive:
            moves += ["trouble"] * 2
            moves += ["port"] * 30 * (("port", cur) not in self.told)
            moves += ["ready_line"] * 10 * (("ready", cur) not in self.told)
        # An operator acts more often on a degraded server (and so the runs reach its edges).
        # A drain of a ready server: often enough that every edge of DRAINING is taken.
        moves += ["drain"] * 2 * (self.m.state is core.State.READY)
        weight = {core.State.DEGRADED: 10, core.State.DRAINING: 30}.get(self.m.state, 1)
        weight *= 1 + (self.m.state is core.State.DRAINING and self.m.ctx.liveness_failures > 0)
        return [*moves, *["operator"] * weight]

    def step(self, move: str) -> None:
        self.now += 0.5  # timers move the clock further (to when they are due)
        cur = self.spawned
        match move:
            case "deliver":
                self.deliver()
            case "timer":
                # Time runs forward to the earliest armed timer.
                name = min(self.timers, key=lambda n: self.timers[n][1])
                event, due = self.timers.pop(name)
                self.now = max(self.now, due)
                self.queue.append(event)
            case "clean":
                self.cleans -= 1
                self.queue.append(
                    self.draw(
                        st.sampled_from(
                            [
                                *[core.HostReady()] * 8,
                                core.HostNotReady("GPU memory still held"),
                                core.HostNotReady("GPU memory still held"),
                                core.HostNotReady("no model yet", model_missing=True),
                                core.HostNotReady("no model yet", model_missing=True),
                                core.HostNotReady("stuck in D state", wedged=True),
                            ]
                        )
                    )
                )
            case "probe":
                launch, kind = self.probes.pop(0)
                if kind is core.ProbeKind.READINESS:
                    result = ok_result() if self.draw(st.booleans()) else self.draw(RESULTS)
                    busy = False  # the daemon reads progress around liveness probes only
                else:
                    result, busy = self.draw(RESULTS), self.draw(st.booleans())
                self.queue.append(core.ProbeDone(launch, kind, result, busy))
            case "stop_done":
                assert self.stopping is not None
                self.alive.discard(self.stopping)
                self.queue.append(core.ChildGone(self.stopping, None, 15))
                self.stopping = None
            case "trouble":
                assert cur is not None
                if self.draw(st.booleans()):
                    self.alive.discard(cur)
                    self.queue.append(core.ChildExited(cur, None, 9))
                else:
                    self.queue.append(core.FatalLog(cur, SCHEDULER_EXCEPTION))
            case "port" | "ready_line":
                assert cur is not None
                self.told.add(("port" if move == "port" else "ready", cur))
                self.queue.append(core.PortOpen(cur) if move == "port" else core.ReadyLine(cur))
            case "drain":
                self.queue.append(core.DrainRequested())
            case "operator":
                # A drained server is mostly given back (else runs seldom leave it that way).
                undrain = ["undrain"] * (12 if self.m.state is core.State.DRAINING else 1)
                what = self.draw(
                    st.sampled_from(["manual", "reload", "primary", "sigterm", "drain", *undrain])
                )
                if what == "drain":
                    self.queue.append(core.DrainRequested())
                elif what == "undrain":
                    self.queue.append(core.UndrainRequested())
                else:
                    self.queue.append(
                        core.StopRequested()
                        if what == "sigterm"
                        else core.RestartRequested(
                            core.Reason.MANUAL if what == "manual" else core.Reason.RELOAD,
                            what == "primary",
                        )
                    )

    def quiescent(self) -> bool:
        return not (
            self.queue or self.timers or self.cleans or self.probes or self.stopping is not None
        )

    def drain(self) -> None:
        """SIGTERM, then let every effect finish: the daemon must reach STOPPED and exit."""
        self.queue.append(core.StopRequested())
        for _ in range(500):
            if self.queue:
                self.deliver()
            elif self.stopping is not None:
                self.step("stop_done")
            elif self.probes:
                launch, kind = self.probes.pop(0)
                self.queue.append(core.ProbeDone(launch, kind, failed_result()))
            elif self.cleans:
                self.cleans -= 1
                self.queue.append(core.HostReady())
            elif self.timers:
                self.step("timer")
            else:
                break
        assert self.m.state is core.State.STOPPED, f"SIGTERM left the machine in {self.m.state}"
        assert self.inv.exits == 1 and not self.alive


def daemon_like_run(
    data: Any, cfg: Config, steps: int, checks: type[Invariants] | None = None
) -> World:
    world = World.started((checks or Invariants)(core.Machine(cfg, T0)), data)
    for _ in range(steps):
        world.step(data.draw(st.sampled_from(world.moves())))
        if world.quiescent():
            # Nothing in flight and nothing queued: only FAILED and STOPPED may wait forever.
            assert world.m.state in (core.State.FAILED, core.State.STOPPED), (
                f"stuck in {world.m.state}"
            )
        if world.m.state is core.State.STOPPED:
            break
    world.drain()
    return world
