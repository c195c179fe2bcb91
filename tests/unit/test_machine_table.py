"""The event x state table in supervisor/core/machine.py's docstring is what the machine does.

Each cell is computed by driving a fresh machine to the column's state (the scripted paths of
testkit.machine.Drive) and sending the row's event for the current launch: the state it lands in,
`=` when it acts but stays, `.` when it ignores the event. The test parses the docstring's
table and compares it cell by cell, and checks every edge it shows against `EDGES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from supervisor.config import Config
from supervisor.core import machine
from supervisor.core.machine import (
    EDGES,
    ChildExited,
    ChildGone,
    ConfigRead,
    DrainRequested,
    Event,
    FatalLog,
    GpuFault,
    GpuUnfit,
    GroupEnded,
    HostNotReady,
    HostReady,
    Launched,
    LaunchFailed,
    PortOpen,
    ProbeDone,
    ProbeKind,
    ReadyLine,
    Reason,
    ReloadRequested,
    RestartRequested,
    SpecCollapsed,
    Start,
    State,
    StopRequested,
    TimerFired,
    TimerName,
    UndrainRequested,
    Verdict,
)
from testkit.machine import CFG, PID, SCHEDULER_EXCEPTION, Drive, failed_result, ok_result

SPEC_FALLBACK_CFG = dataclasses.replace(
    CFG, quality=dataclasses.replace(CFG.quality, on_spec_collapse="fallback")
)


def _with(d: Drive, cfg: Config) -> bool:
    """The row's configuration, taken once the machine is in the column's state."""
    d.cfg = d.m.cfg = cfg
    return True


SHORT = {
    State.STARTING: "STRT",
    State.CLEANING: "CLEN",
    State.WAITING: "WAIT",
    State.LAUNCHING: "LNCH",
    State.LOADING: "LOAD",
    State.WARMING: "WARM",
    State.READY: "RDY",
    State.DEGRADED: "DEGR",
    State.DRAINING: "DRN",
    State.RESTARTING: "RSTR",
    State.FAILED: "FAIL",
    State.STOPPING: "STPG",
    State.STOPPED: "STPD",
}
PATHS: dict[State, Callable[[Drive], Drive]] = {
    State.STARTING: lambda d: d,
    State.CLEANING: Drive.cleaning,
    State.WAITING: Drive.waiting,
    State.LAUNCHING: Drive.launching,
    State.LOADING: Drive.loading,
    State.WARMING: Drive.warming,
    State.READY: Drive.ready,
    State.DEGRADED: Drive.degraded,
    State.DRAINING: Drive.draining,
    State.RESTARTING: Drive.restarting,
    State.FAILED: Drive.failed,
    State.STOPPING: Drive.stopping,
    State.STOPPED: Drive.stopped,
}


def _probe(kind: ProbeKind, ok: bool) -> Callable[[Drive], Event]:
    return lambda d: ProbeDone(d.launch, kind, ok_result() if ok else failed_result())


def _timer(name: TimerName) -> Callable[[Drive], Event]:
    return lambda d: TimerFired(name, d.launch)


ROWS: dict[str, Callable[[Drive], Event]] = {
    "Start": lambda d: Start(),
    "HostReady": lambda d: HostReady(),
    "HostNotReady": lambda d: HostNotReady("port busy"),
    "HostNotReady wedged": lambda d: HostNotReady("D state", wedged=True),
    "HostNotReady model_missing": lambda d: HostNotReady("no model", model_missing=True),
    "Launched": lambda d: Launched(d.launch, PID),
    "LaunchFailed": lambda d: LaunchFailed(d.launch, "no such file"),
    "PortOpen": lambda d: PortOpen(d.launch),
    "ReadyLine": lambda d: ReadyLine(d.launch),
    "FatalLog": lambda d: FatalLog(d.launch, SCHEDULER_EXCEPTION),
    "ChildExited": lambda d: ChildExited(d.launch, 1, None),
    "ChildGone": lambda d: ChildGone(d.launch, 1, None),
    "ChildGone stuck": lambda d: ChildGone(d.launch, None, 9, stuck=(PID,)),
    "readiness ok": _probe(ProbeKind.READINESS, True),
    "readiness failed": _probe(ProbeKind.READINESS, False),
    "liveness ok": _probe(ProbeKind.LIVENESS, True),
    "liveness failed": _probe(ProbeKind.LIVENESS, False),
    "readiness mismatch": lambda d: ProbeDone(
        d.launch, ProbeKind.READINESS, ok_result(), canary_mismatch="expected 'a', got 'b'"
    ),
    "readiness no canary": lambda d: ProbeDone(
        d.launch, ProbeKind.READINESS, ok_result(), canary_unavailable="no canary answer"
    ),
    "liveness no canary": lambda d: ProbeDone(
        d.launch, ProbeKind.LIVENESS, ok_result(), canary_unavailable="no canary answer"
    ),
    "liveness mismatch": lambda d: ProbeDone(
        d.launch, ProbeKind.LIVENESS, ok_result(), canary_mismatch="expected 'a', got 'b'"
    ),
    **{f"timer {n.value}": _timer(n) for n in TimerName},
    "StopRequested": lambda d: StopRequested(),
    "RestartRequested": lambda d: RestartRequested(Reason.MANUAL),
    "ReloadRequested": lambda d: ReloadRequested(),
    "ConfigRead invalid": lambda d: ConfigRead(Verdict.INVALID),
    "ConfigRead unchanged": lambda d: ConfigRead(Verdict.UNCHANGED),
    "ConfigRead changed": lambda d: ConfigRead(Verdict.CHANGED),
    "GpuUnfit": lambda d: GpuUnfit("GPU 0 needs a reset"),
    "GpuFault report": lambda d: GpuFault("GPU 0: Xid 79", restart=False),
    "GpuFault restart": lambda d: GpuFault("GPU 0 is lost", restart=True),
    "DrainRequested": lambda d: DrainRequested(),
    "UndrainRequested": lambda d: UndrainRequested(),
    "GroupEnded": lambda d: GroupEnded(d.launch, "follower left epoch"),
    "SpecCollapsed fallback": lambda d: (
        _with(d, SPEC_FALLBACK_CFG)
        and SpecCollapsed(d.launch, "mean accept length 1.00 below the floor 1.3")
    ),
}


def cell(state: State, row: str) -> str:
    d = PATHS[state](Drive())
    assert d.state is state
    actions = d.send(ROWS[row](d), after=1.0)
    if not actions:
        return "."
    return "=" if d.state is state else SHORT[d.state]


def render() -> list[str]:
    width = max(map(len, ROWS)) + 1
    lines = [" " * width + " ".join(f"{SHORT[s]:<4}" for s in State)]
    for row in ROWS:
        cells = " ".join(f"{cell(s, row):<4}" for s in State)
        lines.append(f"{row:<{width}}{cells}".rstrip())
    return lines


def documented() -> list[str]:
    doc = machine.__doc__ or ""
    start = doc.index("```table\n") + len("```table\n")
    return [line.rstrip() for line in doc[start : doc.index("```", start)].splitlines()]


def test_the_documented_table_is_what_the_machine_does() -> None:
    assert documented() == render(), "\n" + "\n".join(render())


def test_every_edge_in_the_table_is_an_edge_of_the_machine() -> None:
    by_short = {v: k for k, v in SHORT.items()}
    lines = documented()
    header = lines[0].split()
    assert [by_short[h] for h in header] == list(State)
    seen = set()
    for line in lines[1:]:
        cells = line.split()[-len(header) :]
        for source, target in zip(State, cells, strict=True):
            if target in (".", "="):
                continue
            new = by_short[target]
            seen.add((source, new))
            # One edge, or two through STOPPING (a stop with nothing to stop ends at once).
            via_stopping = State.STOPPING in EDGES[source] and new in EDGES[State.STOPPING]
            assert new in EDGES[source] or via_stopping, f"{source} -> {new} is not in EDGES"
    assert seen, "the table shows no transition at all"
