"""GPU hygiene: the launch-record sweep, counted, and /status.leftovers.

`sweep_leftovers()` kills an earlier launch's processes (launch record, owner marker) and says
what each held on which GPU; `leftover_status()` joins its report with `clean()`'s for /status.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil

from supervisor.gpu.classify import ProcFacts, _distrust
from supervisor.gpu.clean import CleanReport, _short, _size, _snapshot, gather_facts
from supervisor.gpu.nvml import Nvml, NvmlUnavailable
from supervisor.process.identity import ProcessIdentity, same_start

# --------------------------------------------------------------------------------------------
# The launch-record sweep, counted
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweptProcess:
    pid: int
    create_time: float
    found_by: str  # "launch record" or "owner marker"
    cmdline: str
    held: tuple[tuple[int, str, int | None], ...]  # (GPU index, UUID, bytes) per NVML, pre-kill
    killed: bool  # gone after the sweep (False: it survives SIGKILL, D state)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "found_by": self.found_by,
            "cmdline": self.cmdline,
            "gpus": [g for g, _u, _b in self.held],
            "held": [{"gpu": g, "uuid": u, "used_bytes": b} for g, u, b in self.held],
            "used_bytes": None
            if any(b is None for _g, _u, b in self.held)
            else sum(b or 0 for _g, _u, b in self.held),
            "action": "SIGKILL: exited" if self.killed else "SIGKILL: still running",
        }

    def describe(self) -> str:
        held = ", ".join(f"GPU {g}: {_size(b)}" for g, _u, b in self.held) or "no GPU memory"
        what = f", {_short(self.cmdline)}" if self.cmdline else ""
        return f"pid {self.pid} ({self.found_by}{what}, {held})"


@dataclass
class SweepReport:
    """What the sweep of an earlier launch's processes (launch record, owner marker) killed,
    with the GPU memory each held as NVML listed it before the kill."""

    processes: list[SweptProcess] = field(default_factory=list)
    stuck: list[ProcessIdentity] = field(default_factory=list)
    nvml_error: str | None = None  # NVML could not say what they held
    # Recorded, but not killed: another user's, or holding no GPU memory with no evidence of
    # being ours (the record is the service user's own word). One line each.
    spared: list[str] = field(default_factory=list)

    def killed_rows(self) -> list[tuple[str, str, int]]:
        """(gpu, UUID, count) rows; gpu "none" for a killed process that held no GPU memory."""
        counts: dict[tuple[str, str], int] = {}
        for p in self.processes:
            if not p.killed:
                continue
            for key in [(str(g), u) for g, u, _b in p.held] or [("none", "none")]:
                counts[key] = counts.get(key, 0) + 1
        return [(g, u, n) for (g, u), n in sorted(counts.items())]

    def message(self) -> str:
        killed = [p for p in self.processes if p.killed]
        if not killed:
            return "no process of an earlier launch was left"
        return f"killed {len(killed)} process(es) of an earlier launch: " + "; ".join(
            p.describe() for p in killed
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "processes": [p.to_dict() for p in self.processes],
            "killed": {f"{g}": n for g, _u, n in self.killed_rows()},
            "stuck": [i.pid for i in self.stuck],
            "nvml_error": self.nvml_error,
            "message": self.message(),
        }


async def sweep_leftovers(
    sweep: Callable[[set[ProcessIdentity]], Awaitable[list[ProcessIdentity]]],
    nvml: Nvml | None,
    recorded: set[ProcessIdentity],
    marked: set[ProcessIdentity],
    *,
    facts: Callable[[Iterable[int]], Mapping[int, ProcFacts]] = gather_facts,
    match: tuple[str, ...] = (),
    owner: str | None = None,
    uid: int | None = None,
) -> SweepReport:
    """Kill an earlier launch's processes through `sweep` (ProcessOwner.sweep) and say what each
    held. NVML is read before the kill: afterwards the memory is free and the pid unlisted
    (within 0.25 s on an H200, docs/gpu.md). Every GPU NVML lists counts, managed or not:
    what a recorded process of ours held anywhere is ours.

    `marked` (owner marker, the launch's session) is evidence of its own; a process only
    `recorded` is killed when it runs as `uid` (default: ours) and holds GPU memory, carries
    `owner`'s marker or matches `match`."""
    report = SweepReport()
    if not recorded | marked:
        return report
    held: dict[int, list[tuple[int, str, int | None]]] = {}
    if nvml is not None:
        try:
            snaps = await _snapshot(nvml, "all")
        except NvmlUnavailable as exc:
            report.nvml_error = str(exc)
        else:
            for snap in snaps:
                for p in snap.processes:
                    held.setdefault(p.pid, []).append((snap.index, snap.uuid, p.used_bytes))
    want = os.getuid() if uid is None else uid
    seen = facts(i.pid for i in recorded | marked)
    targets = set(marked)
    alive = []
    for ident in sorted(recorded | marked):
        f = seen.get(ident.pid)
        if f is None or not same_start(ident.create_time, f.create_time):
            continue  # gone already, or the pid names another process now: nothing to kill
        if ident not in marked:
            why = _distrust(
                f, ident.pid in held, owner=owner, leader=None, match=match, daemon_uid=want
            )
            if why:
                report.spared.append(f"pid {ident.pid}: {why}")
                continue
            targets.add(ident)
        if f.status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            continue
        alive.append((ident, f))
    stuck = set(await sweep(targets))
    report.stuck = sorted(stuck)
    for ident, f in alive:
        report.processes.append(
            SweptProcess(
                pid=ident.pid,
                create_time=ident.create_time,
                found_by="launch record" if ident in recorded else "owner marker",
                cmdline=" ".join(f.cmdline),
                held=tuple(held.get(ident.pid, ())),
                killed=ident not in stuck,
            )
        )
    return report


def leftover_status(sweep: SweepReport | None, clean: CleanReport | None) -> dict[str, Any]:
    """/status.leftovers: every leftover removed before the last launch, however it was found,
    with its GPU and what it held; `killed` per GPU as the counter counts them."""
    procs: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    for rows, items in (
        (
            sweep.killed_rows() if sweep else [],
            [p.to_dict() for p in sweep.processes] if sweep else [],
        ),
        (clean.killed_rows() if clean else [], clean.leftovers() if clean else []),
    ):
        procs += items
        for g, _u, n in rows:
            counts[g] = counts.get(g, 0) + n
    return {"killed": counts, "processes": procs}
