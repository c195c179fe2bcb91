"""The daemon's parts, built once and handed to `Daemon` whole (`wire`).

Each part gets what it works with through its constructor: the machine's context (read only),
the inbox's `emit` and `spawn`, the effects, and the other parts it reads. After `wire` nothing
is assigned onto a part from outside; a reload reaches every part that holds the configuration
through one method, `reconfigure(cfg)` (`Parts.holders`), and the router link through
`RouterSlot.relink`, both called by `Daemon.reconfigure` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from supervisor import log
from supervisor.config import Config
from supervisor.core.machine import Machine
from supervisor.daemon.effects import Effects
from supervisor.daemon.group import Group
from supervisor.daemon.inbox import Inbox
from supervisor.daemon.launcher import Launcher
from supervisor.daemon.links import RouterSlot
from supervisor.daemon.logpump import LogPump
from supervisor.daemon.observed import Gpus, Observed
from supervisor.daemon.quality_watch import QualityWatch
from supervisor.incidents.recorder import IncidentRecorder
from supervisor.sglang.probe import ProbeGate
from supervisor.warm import Warm


class Reconfigurable(Protocol):
    def reconfigure(self, cfg: Config) -> None:
        """A reload took `cfg`: what the part does next follows it."""


@dataclass(frozen=True)
class Parts:
    machine: Machine
    inbox: Inbox
    gpus: Gpus  # NVML and the fitness watch, once the start opened them
    links: RouterSlot
    warm: Warm  # caches made and measured, weights prewarmed (docs/benchmarks.md)
    recorder: IncidentRecorder  # the evidence of each restart nobody asked for (docs/incidents.md)
    quality: QualityWatch  # the canary, decode speed, accept length, graphs (docs/quality.md)
    group: Group | None  # a multi-node replica coordinated over the admin endpoints
    observed: Observed
    pump: LogPump
    launcher: Launcher
    gate: ProbeGate  # at most one decode probe in flight against SGLang

    def holders(self) -> list[Reconfigurable]:
        """Every part that reads the configuration."""
        parts: list[Reconfigurable] = [self.machine, self.observed, self.launcher, self.warm]
        parts += [self.pump, self.recorder, self.quality]
        return parts if self.group is None else [*parts, self.group]


def wire(cfg: Config, fx: Effects) -> Parts:
    machine = Machine(cfg, fx.clock())
    inbox = Inbox(failed=machine.internal_error)
    emit, spawn = inbox.emit, inbox.spawn

    def progress() -> None:  # the prewarm's progress: STATUS= again, with its note
        fx.notifier.status(observed.status_line(public=True))

    warmer = Warm(cfg, fx.clock, spawn, progress)
    recorder = IncidentRecorder(cfg, wall=fx.wall, load_extras=warmer.current)
    quality = QualityWatch(cfg, fx.http, fx.metrics, emit)
    links = RouterSlot.made(cfg, log.get(), fx.metrics, fx.router_http)
    group = (
        Group(cfg, machine.ctx, fx.http, emit, fx.clock, fx.metrics) if cfg.group.answers else None
    )
    gpus = Gpus()
    observed = Observed(
        cfg,
        machine.ctx,
        fx.metrics,
        fx.clock,
        fx.wall,
        gpus=gpus,
        links=links,
        recorder=recorder,
        quality=quality,
        group=group,
        note=warmer.note,
    )

    def line(text: str, mono_now: float) -> None:  # each SGLang line, with when it was read
        recorder.line(text, mono_now)
        quality.line(text)

    pump = LogPump(cfg, fx.metrics, fx.clock, emit, on_line=line, own_request=fx.own_ports.ours)
    launcher = Launcher(
        cfg,
        machine.ctx,
        fx.owner,
        fx.store,
        observed,
        emit,
        spawn,
        links,
        http=fx.http,
        recorder=recorder,
    )
    fx.owner.bind(pump.lines, launcher.exited)
    return Parts(
        machine=machine,
        inbox=inbox,
        gpus=gpus,
        links=links,
        warm=warmer,
        recorder=recorder,
        quality=quality,
        group=group,
        observed=observed,
        pump=pump,
        launcher=launcher,
        gate=ProbeGate(),
    )
