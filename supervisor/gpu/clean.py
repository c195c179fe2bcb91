"""GPU hygiene, the effects: remove our leftovers, wait until memory is free.

`clean()`: SIGTERM, grace, SIGKILL, each signal preceded by a (pid, create time) check; then
wait until NVML shows the memory free, because the driver releases it asynchronously and a
launch before that fails with out-of-memory ten minutes later (sglang PR #39545 waits the same
way). What is signalled is decided by the pure `supervisor.gpu.classify.classify()`, from the
facts `gather_facts()` reads through psutil.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from supervisor.config import GpusConfig
from supervisor.gpu.classify import Classified, Kind, ProcFacts, classify
from supervisor.gpu.nvml import GiB, GpuSnapshot, MiB, Nvml, NvmlUnavailable, gpu_status, select
from supervisor.process import signals
from supervisor.process.identity import OWNER_ENV, ProcessIdentity, live_process
from supervisor.threads import in_thread

# An NVML call that takes longer than this means a hung driver or GPU; nvidia-smi hangs too.
NVML_CALL_TIMEOUT = 10.0


# --------------------------------------------------------------------------------------------
# Facts about processes, read through psutil
# --------------------------------------------------------------------------------------------


def gather_facts(pids: Iterable[int]) -> dict[int, ProcFacts]:
    """psutil's view of each pid; a pid that does not exist (here) is left out."""
    out = {}
    for pid in set(pids):
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                status = proc.status()
                create_time = proc.create_time()
                ppid = proc.ppid()
                uid: int | None = proc.uids().real
                cmdline: tuple[str, ...] = ()
                username: str | None = None
                owner: str | None = None
                with contextlib.suppress(psutil.AccessDenied, psutil.ZombieProcess):
                    cmdline = tuple(proc.cmdline())
                with contextlib.suppress(psutil.AccessDenied, psutil.ZombieProcess, KeyError):
                    username = proc.username()
                with contextlib.suppress(psutil.AccessDenied, psutil.ZombieProcess, OSError):
                    owner = proc.environ().get(OWNER_ENV)
                sid = pgid = None
                with contextlib.suppress(OSError):
                    sid, pgid = os.getsid(pid), os.getpgid(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
        out[pid] = ProcFacts(
            pid, create_time, cmdline, uid, username, status, ppid, owner, sid, pgid
        )
    return out


# --------------------------------------------------------------------------------------------
# Cleaning
# --------------------------------------------------------------------------------------------


@dataclass
class CleanReport:
    ok: bool  # every managed GPU free: nothing of ours on it, used memory under the threshold
    message: str  # one line for STATUS= / `systemctl status`
    found: list[Classified] = field(default_factory=list)
    killed: dict[int, int] = field(default_factory=dict)  # GPU index -> leftovers removed
    foreign: list[Classified] = field(default_factory=list)
    wedged: list[str] = field(default_factory=list)  # non-empty: retrying cannot help
    release_seconds: float | None = None
    actions: dict[int, str] = field(default_factory=dict)  # pid -> what was done to it
    before: list[dict[str, Any]] = field(default_factory=list)  # gpu_status() at the start
    after: list[dict[str, Any]] = field(default_factory=list)  # gpu_status() at the end
    dry_run: bool = False
    killed_without_gpu: int = 0  # leftovers removed that held no GPU memory (a detokenizer)

    def killed_rows(self) -> list[tuple[str, str, int]]:
        """(gpu, UUID, count) for kimi_serve_gpu_leftover_processes_killed_total; gpu "none"
        for leftovers that held no GPU memory, so every leftover is counted."""
        uuids = {g["index"]: str(g["uuid"]) for g in self.before}
        rows = [(str(i), uuids.get(i, "unknown"), n) for i, n in sorted(self.killed.items())]
        if self.killed_without_gpu:
            rows.append(("none", "none", self.killed_without_gpu))
        return rows

    def leftovers(self) -> list[dict[str, Any]]:
        """What each leftover was, what it held (per NVML, before the kill) and what was done."""
        return [
            {
                "pid": c.pid,
                "found_by": c.found_by,
                "gpus": list(c.gpus),
                "used_bytes": c.used_bytes,
                "cmdline": _short(c.cmdline, 120),
                "action": self.actions.get(c.pid or 0, ""),
            }
            for c in self.found
            if c.to_remove
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "message": self.message,
            "found": [c.to_dict() for c in self.found],
            "killed": {str(k): v for k, v in sorted(self.killed.items())},
            "foreign": [c.to_dict() for c in self.foreign],
            "wedged": list(self.wedged),
            "release_seconds": self.release_seconds,
            "actions": {str(k): v for k, v in sorted(self.actions.items())},
            "before": self.before,
            "after": self.after,
            "dry_run": self.dry_run,
            "killed_without_gpu": self.killed_without_gpu,
            "leftovers": self.leftovers(),
        }


def _size(n: int | None) -> str:
    if n is None:
        return "? MiB"
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def _gpu_name(snap: GpuSnapshot) -> str:
    return f"GPU {snap.index} ({snap.uuid[:12]})"


def _short(cmdline: str, width: int = 60) -> str:
    # One line whatever the command line holds: a newline would split a STATUS= message.
    # The middle goes: the program is at the start, SGLang's process title at the end.
    flat = " ".join(cmdline.split())
    if len(flat) <= width:
        return flat
    head = (width - 5) // 2
    return f"{flat[:head]} ... {flat[-(width - 5 - head) :]}"


def _holder(c: Classified) -> str:
    if c.pid is None:
        return "no process listed by NVML"
    what = c.cmdline and f", {_short(c.cmdline)}"
    stuck = " stuck in the driver (D state)" if c.kind is Kind.STUCK else ""
    return f"pid {c.pid}{stuck} ({c.kind.value}{what}, {_size(c.used_bytes)})"


def _wedged_line(c: Classified) -> str:
    where = ", ".join(f"GPU {g}" for g in c.gpus)
    if c.pid is None:
        return f"{where}: {_size(c.used_bytes)} held with no process listed by NVML"
    return f"{where}: {_holder(c)}: {c.reason}"


def _per_gpu(counts: Mapping[int, int]) -> str:
    return ", ".join(f"GPU {g}: {n}" for g, n in sorted(counts.items()))


async def _snapshot(nvml: Nvml, devices: str | tuple[int | str, ...]) -> list[GpuSnapshot]:
    # NVML blocks in the driver; a hung GPU must not stall the daemon's loop (and its watchdog).
    try:
        snaps = await in_thread(nvml.snapshot, NVML_CALL_TIMEOUT)
    except TimeoutError:
        raise NvmlUnavailable(
            f"NVML did not answer within {NVML_CALL_TIMEOUT:g}s: the driver or a GPU is hung "
            "(nvidia-smi will hang too); the host needs attention"
        ) from None
    return select(snaps, devices)


def _busy(snaps: Sequence[GpuSnapshot], threshold: int, ours: set[int]) -> list[GpuSnapshot]:
    return [
        s
        for s in snaps
        if s.memory_used_bytes > threshold or any(p.pid in ours for p in s.processes)
    ]


async def _terminate(
    targets: list[Classified], grace: float, clock: Callable[[], float], poll: float
) -> dict[int, str]:
    idents = [c.identity for c in targets if c.identity is not None]
    # No wait after SIGKILL here: the caller waits for the GPU memory, which is what matters.
    done = await signals.terminate(idents, grace=grace, kill_wait=0, clock=clock, poll=poll)
    return done.notes


def _reap(c: Classified) -> str:
    """A zombie that is our own child is reaped here; any other is its parent's (or init's)."""
    if c.pid is None or c.ppid != os.getpid():
        return f"left for its parent (pid {c.ppid}) to reap"
    try:
        reaped, _ = os.waitpid(c.pid, os.WNOHANG)
    except ChildProcessError:
        return "already reaped"
    return "reaped" if reaped else "not reaped yet"


async def clean(
    cfg: GpusConfig,
    nvml: Nvml,
    *,
    current: set[ProcessIdentity],
    recorded: set[ProcessIdentity],
    dry_run: bool = False,
    term_grace: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    poll: float = 0.1,
    daemon_uid: int | None = None,
    owner: str | None = None,
    facts: Callable[[Iterable[int]], Mapping[int, ProcFacts]] = gather_facts,
) -> CleanReport:
    """Remove our leftovers from the managed GPUs and wait until their memory is free.

    `current`: the running launch's processes (never touched). `recorded`: what earlier launches
    recorded; those still alive are removed even when they hold no GPU memory (a detokenizer, a
    scheduler still loading). `daemon_uid` (default: ours) is whose `match` hits count as ours;
    `owner` is the daemon's KIMI_SERVE_OWNER value. Never raises for NVML trouble: the report
    says it, with `wedged` set since retrying cannot help.
    """
    uid = os.getuid() if daemon_uid is None else daemon_uid
    threshold = cfg.memory_free_threshold_mib * MiB
    started = clock()

    def classify_now(snaps: Sequence[GpuSnapshot], with_recorded: bool) -> list[Classified]:
        ids = recorded if with_recorded else set()
        pids = {p.pid for s in snaps for p in s.processes} | {i.pid for i in ids}
        return classify(
            snaps, facts(pids), current, ids, cfg.match, uid, owner=owner, threshold_bytes=threshold
        )

    try:
        snaps = await _snapshot(nvml, cfg.devices)
    except NvmlUnavailable as exc:
        return CleanReport(ok=False, message=str(exc), wedged=[str(exc)], dry_run=dry_run)
    found = classify_now(snaps, with_recorded=True)
    report = CleanReport(
        ok=False,
        message="",
        found=found,
        foreign=[c for c in found if c.kind is Kind.FOREIGN],
        before=gpu_status(snaps),
        after=gpu_status(snaps),
        dry_run=dry_run,
    )
    targets = [c for c in found if c.to_remove]
    ours = {c.pid for c in found if c.ours and c.pid is not None and c.kind is not Kind.CURRENT}
    removable = not dry_run and cfg.leftover_policy == "kill-matching"
    for c in targets:
        assert c.pid is not None
        if dry_run:
            report.actions[c.pid] = "dry run: would SIGTERM, then SIGKILL"
        elif not removable:
            report.actions[c.pid] = "left running (gpus.leftover_policy: report-only)"
    t0 = started
    if removable and targets:
        t0 = clock()
        report.actions.update(await _terminate(targets, term_grace, clock, poll))
    if not dry_run:
        for c in found:
            if c.kind is Kind.ZOMBIE and c.ours and c.pid is not None:
                report.actions[c.pid] = _reap(c)

    signalled = [
        c.identity
        for c in targets
        if c.identity is not None and report.actions.get(c.pid or 0, "").startswith("SIG")
    ]
    busy = _busy(snaps, threshold, ours)
    if not dry_run:
        # NVML has no event for "memory released": poll it (cheap, ~1 ms per GPU) against the
        # deadline. On H200 the memory was free at the first sample after a kill, 0.23 s.
        # Signalled leftovers that hold no GPU memory are waited for too, on the same deadline.
        deadline = clock() + cfg.memory_free_timeout
        while True:
            try:
                snaps = await _snapshot(nvml, cfg.devices)
            except NvmlUnavailable as exc:
                report.message, report.wedged = str(exc), [str(exc)]
                return report
            busy = _busy(snaps, threshold, ours)
            if not busy and report.release_seconds is None:
                report.release_seconds = clock() - t0
            lingering = [i for i in signalled if live_process(i) is not None]
            if (not busy and not lingering) or clock() >= deadline:
                break
            await asyncio.sleep(poll)
        report.after = gpu_status(snaps)

    for c in targets:
        if c.identity is not None and c.identity in signalled:
            gone = live_process(c.identity) is None
            report.actions[c.identity.pid] += ": exited" if gone else ": still running"
            for g in c.gpus if gone else ():
                report.killed[g] = report.killed.get(g, 0) + 1
            if gone and not c.gpus:
                report.killed_without_gpu += 1

    report.ok = not busy
    waited = clock() - started
    if busy:
        holders = [c for c in classify_now(busy, with_recorded=True) if c.gpus]
        report.wedged += [_wedged_line(c) for c in holders if c.kind in (Kind.WEDGED, Kind.STUCK)]
        report.message = _busy_message(busy, holders, waited, cfg, report.wedged, dry_run)
    else:
        report.message = _ok_message(snaps, report, targets, dry_run)
    return report


def _busy_message(
    busy: list[GpuSnapshot],
    holders: list[Classified],
    waited: float,
    cfg: GpusConfig,
    wedged: list[str],
    dry_run: bool,
) -> str:
    first = busy[0]
    on_first = sorted(
        (c for c in holders if first.index in c.gpus),
        key=lambda c: -(c.used_bytes or 0),
    )
    who = "; ".join(_holder(c) for c in on_first[:2]) or "no process listed by NVML"
    after = "" if dry_run else f" after {waited:.1f}s"
    msg = (
        f"{_gpu_name(first)} still holds {_size(first.memory_used_bytes)}{after} "
        f"(free means under {cfg.memory_free_threshold_mib} MiB): held by {who}"
    )
    if len(busy) > 1:
        msg += f"; {len(busy) - 1} more GPU(s) busy: " + ", ".join(str(s.index) for s in busy[1:])
    if wedged:
        msg += "; GPU wedged: retrying cannot help, it needs a GPU reset or a reboot"
    return ("dry run: " + msg) if dry_run else msg


def _ok_message(
    snaps: list[GpuSnapshot], report: CleanReport, targets: list[Classified], dry_run: bool
) -> str:
    gpus = ",".join(str(s.index) for s in snaps)
    parts = [f"GPU {gpus} free" if len(snaps) == 1 else f"GPUs {gpus} free"]
    if dry_run and targets:
        parts.append(f"dry run: {len(targets)} leftover process(es) would be removed")
    elif targets:
        n = sum(1 for c in targets if report.actions.get(c.pid or 0, "").endswith(": exited"))
        per_gpu = f" ({_per_gpu(report.killed)})" if report.killed else ""
        parts.append(
            f"removed {n} leftover process(es){per_gpu}, "
            f"memory free after {report.release_seconds or 0:.2f}s"
        )
    elif not dry_run:
        parts.append("no leftovers")
    if report.foreign:
        pids = ", ".join(str(c.pid) for c in report.foreign)
        parts.append(f"{len(report.foreign)} foreign process(es) left alone (pid {pids})")
    return "; ".join(parts)
