"""GPU hygiene: find the processes on our GPUs, remove our leftovers, wait until memory is free.

Two layers over NVML (`supervisor.nvml`, which says what is on each GPU), in the order a reader
meets them:

- `classify()`: pure. From NVML's view, each process's psutil facts and what this daemon launched
  it decides what every process on our GPUs is. Only our own leftovers are ever signalled.
- `clean()`: the effects. SIGTERM, grace, SIGKILL, each signal preceded by a (pid, create time)
  check; then wait until NVML shows the memory free, because the driver releases it
  asynchronously and a launch before that fails with out-of-memory ten minutes later
  (sglang PR #39545 waits the same way).

Why leftovers exist at all: an SGLang scheduler still loading when its parent dies has not yet
set PR_SET_PDEATHSIG and keeps its GPU memory (sglang #23627).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TextIO

import psutil

from supervisor import signals
from supervisor.config import Config, GpusConfig
from supervisor.identity import (
    CREATE_TIME_SLACK,
    OWNER_ENV,
    ProcessIdentity,
    RecordStore,
    descendants,
    launch_leader,
    live_process,
    owner_marker,
    same_start,
)
from supervisor.nvml import (
    GiB,
    GpuSnapshot,
    MiB,
    Nvml,
    NvmlOpener,
    NvmlUnavailable,
    gpu_status,
    select,
)
from supervisor.threads import in_thread

# An NVML call that takes longer than this means a hung driver or GPU; nvidia-smi hangs too.
NVML_CALL_TIMEOUT = 10.0


# --------------------------------------------------------------------------------------------
# Facts about processes, and the pure classification
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcFacts:
    pid: int
    create_time: float
    cmdline: tuple[str, ...]  # empty for a zombie or when the kernel hides it
    uid: int | None  # real uid
    username: str | None
    status: str  # psutil.STATUS_*: "running", "sleeping", "disk-sleep", "zombie", ...
    ppid: int | None
    owner: str | None = None  # the KIMI_SERVE_OWNER marker every process we launch inherits
    # Session and process group ids: a launch's main process leads both (start_new_session),
    # and they survive setproctitle wiping the marker from a worker's environment.
    sid: int | None = None
    pgid: int | None = None


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


class Kind(StrEnum):
    CURRENT = "current"  # the daemon's own SGLang of this launch: left alone
    LEFTOVER = "leftover"  # ours from an earlier launch: removed (policy permitting)
    FOREIGN = "foreign"  # anyone else's: never signalled, reported
    ZOMBIE = "zombie"  # exited, not reaped: holds no GPU memory; reaped if it is our child
    STUCK = "stuck"  # D state in the driver: no signal reaches it; the GPU is wedged
    WEDGED = "wedged"  # memory held and no process we can see holds it


@dataclass(frozen=True)
class Classified:
    kind: Kind
    pid: int | None  # None: memory with no process listed at all
    gpus: tuple[int, ...]  # indexes where it holds memory; () for a recorded one holding none
    used_bytes: int | None  # summed over `gpus`; None when NVML does not say
    ours: bool
    reason: str
    identity: ProcessIdentity | None = None
    cmdline: str = ""
    user: str | None = None
    ppid: int | None = None
    # How it was found to be ours: "launch record", "owner marker" or "nvml" (a gpus.match hit
    # among NVML's processes); "" for what is not ours.
    found_by: str = ""

    @property
    def to_remove(self) -> bool:
        """Ours and to be signalled: a leftover, or one of ours in D state (a SIGKILL stays
        pending and lands if it ever leaves the driver)."""
        return self.kind is Kind.LEFTOVER or (self.kind is Kind.STUCK and self.ours)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "pid": self.pid,
            "gpus": list(self.gpus),
            "used_bytes": self.used_bytes,
            "ours": self.ours,
            "reason": self.reason,
            "create_time": self.identity.create_time if self.identity else None,
            "cmdline": self.cmdline,
            "user": self.user,
            "ppid": self.ppid,
            "found_by": self.found_by,
        }


def _start_times(idents: Iterable[ProcessIdentity]) -> dict[int, float]:
    return {i.pid: i.create_time for i in idents}


def _decide(
    f: ProcFacts,
    *,
    current: bool,
    recorded: bool,
    match: tuple[str, ...],
    daemon_uid: int,
    owner: str | None,
    session: int | None = None,
    distrusted: str = "",
) -> tuple[Kind, bool, str]:
    joined = " ".join(f.cmdline)
    hit = next((m for m in match if m in joined), None)
    other_daemon = owner is not None and f.owner is not None and f.owner != owner
    # The marker is an environment variable anyone can set: it counts under our uid only.
    mine = owner is not None and f.owner == owner and f.uid == daemon_uid
    matched_mine = hit is not None and f.uid == daemon_uid and not other_daemon
    in_launch = session is not None
    ours = current or recorded or in_launch or mine or matched_mine
    if current:
        return Kind.CURRENT, True, "the daemon's current launch"
    if f.status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return Kind.ZOMBIE, ours, f"exited, not yet reaped by its parent (pid {f.ppid})"
    if f.status == psutil.STATUS_DISK_SLEEP:
        return Kind.STUCK, ours, "in uninterruptible sleep (D state): no signal reaches it"
    if recorded:
        return Kind.LEFTOVER, True, "recorded by an earlier launch of this daemon"
    if in_launch:
        return (
            Kind.LEFTOVER,
            True,
            f"in the process session of an earlier launch of this daemon (session {session})",
        )
    if mine:
        return Kind.LEFTOVER, True, f"carries this daemon's {OWNER_ENV} marker"
    if distrusted:
        return Kind.FOREIGN, False, distrusted
    if other_daemon:
        return Kind.FOREIGN, False, f"launched by another kimi-serve ({OWNER_ENV}={f.owner})"
    if hit is not None:
        if f.uid == daemon_uid:
            return Kind.LEFTOVER, True, f"command line matches {hit!r} (gpus.match)"
        who = f.username or f"uid {f.uid}"
        return (
            Kind.FOREIGN,
            False,
            f"matches {hit!r} but runs as {who}, not the daemon's uid {daemon_uid}",
        )
    return Kind.FOREIGN, False, "not launched by this daemon and does not match gpus.match"


def _session_leader(
    recorded: set[ProcessIdentity], facts: Mapping[int, ProcFacts]
) -> ProcessIdentity | None:
    """The recorded launch's main process, if its pid can still name the launch's session:
    alive as the recorded process, or gone (a pid that names a session is not reused)."""
    leader = launch_leader(recorded)
    if leader is None:
        return None
    now = facts.get(leader.pid)
    if now is not None and not same_start(leader.create_time, now.create_time):
        return None  # the pid names another process now
    return leader


def _in_session(f: ProcFacts, leader: ProcessIdentity | None, uid: int) -> int | None:
    """The session id when `f` belongs to the recorded launch's session or process group and
    runs as the launch's user (a dead leader's session id may be another user's now)."""
    if leader is None or f.pid == leader.pid or leader.pid not in (f.sid, f.pgid):
        return None
    if f.uid != uid:
        return None
    if f.create_time + CREATE_TIME_SLACK < leader.create_time:
        return None  # older than the launch: cannot be one of its processes
    return leader.pid


def _distrust(
    f: ProcFacts,
    held: bool,
    *,
    owner: str | None,
    leader: ProcessIdentity | None,
    match: tuple[str, ...],
    daemon_uid: int,
) -> str:
    """Why a process the launch record lists is not ours after all; "" when it is.

    The record is written by the service user, whose SGLang runs model code: it counts only for
    that user's processes, and for one holding no GPU memory only with evidence of its own."""
    if f.uid != daemon_uid:
        who = f.username or f"uid {f.uid}"
        return (
            f"listed in the launch record but runs as {who}, not the service user's "
            f"uid {daemon_uid}: not ours"
        )
    if held or f.status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return ""  # a zombie gets no signal: only reaped, and only by its parent
    joined = " ".join(f.cmdline)
    if (
        (owner is not None and f.owner == owner)
        or _in_session(f, leader, daemon_uid) is not None
        or any(m in joined for m in match)
    ):
        return ""
    return (
        "listed in the launch record but holds no GPU memory and shows no sign of being ours "
        f"(no {OWNER_ENV} marker, not in the launch's session, no gpus.match hit)"
    )


def classify(
    snapshots: Sequence[GpuSnapshot],
    facts: Mapping[int, ProcFacts],
    ours_current: set[ProcessIdentity],
    ours_recorded: set[ProcessIdentity],
    match: tuple[str, ...],
    daemon_uid: int,
    *,
    owner: str | None = None,
    threshold_bytes: int = 0,
) -> list[Classified]:
    """What each process on the given GPUs (and each recorded one still alive) is.

    Policy, in order: the current launch is left alone; a zombie holds nothing; D state is
    stuck; a recorded (pid, create time), a member of the recorded launch's session (its main
    process leads it; this survives setproctitle wiping a worker's environment), or our owner
    marker is ours whatever its command line says; another daemon's marker is foreign; a
    `match` hit is ours only under the daemon's own uid (never kill someone else's);
    everything else is foreign. A GPU that holds more than `threshold_bytes` with no process
    listed, or lists a pid no one can see, is wedged.
    """
    on_gpu: dict[int, list[tuple[int, int | None]]] = {}
    out: list[Classified] = []
    for snap in snapshots:
        for p in snap.processes:
            on_gpu.setdefault(p.pid, []).append((snap.index, p.used_bytes))
        if not snap.processes and snap.memory_used_bytes > threshold_bytes:
            out.append(
                Classified(
                    Kind.WEDGED,
                    None,
                    (snap.index,),
                    snap.memory_used_bytes,
                    False,
                    "memory held with no process listed by NVML",
                )
            )
    current = _start_times(ours_current)
    recorded = _start_times(ours_recorded)
    # Only the service user's recorded processes (or gone ones) may lead the launch's session.
    leader = _session_leader(
        {i for i in ours_recorded if (g := facts.get(i.pid)) is None or g.uid == daemon_uid},
        facts,
    )
    for pid in sorted(set(on_gpu) | set(recorded)):
        held = on_gpu.get(pid, [])
        gpus = tuple(g for g, _ in held)
        used = None if any(b is None for _, b in held) else sum(b or 0 for _, b in held)
        f = facts.get(pid)
        if f is None:
            if held:
                out.append(
                    Classified(
                        Kind.WEDGED,
                        pid,
                        gpus,
                        used,
                        False,
                        "NVML lists this pid but no such process is visible "
                        "(exited inside the driver, or in another PID namespace)",
                    )
                )
            continue
        listed = same_start(recorded.get(pid), f.create_time)
        if not held and not listed:
            continue  # a recorded pid now names some other process, which holds no GPU memory
        distrusted = (
            _distrust(f, bool(held), owner=owner, leader=leader, match=match, daemon_uid=daemon_uid)
            if listed
            else ""
        )
        is_recorded = listed and not distrusted
        kind, ours, reason = _decide(
            f,
            current=same_start(current.get(pid), f.create_time),
            recorded=is_recorded,
            match=match,
            daemon_uid=daemon_uid,
            owner=owner,
            session=_in_session(f, leader, daemon_uid),
            distrusted=distrusted,
        )
        found_by = ""
        if ours and kind is not Kind.CURRENT:
            if is_recorded:
                found_by = "launch record"
            elif owner is not None and f.owner == owner and f.uid == daemon_uid:
                found_by = "owner marker"
            else:
                found_by = "nvml"
        out.append(
            Classified(
                kind,
                pid,
                gpus,
                used,
                ours,
                reason,
                identity=ProcessIdentity(pid, f.create_time),
                cmdline=" ".join(f.cmdline),
                user=f.username,
                ppid=f.ppid,
                found_by=found_by,
            )
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


# --------------------------------------------------------------------------------------------
# `kimi-serve gpu-clean`
# --------------------------------------------------------------------------------------------


def _daemon_uid(state_dir: str) -> int:
    # The daemon's user owns its state directory (systemd's StateDirectory= chowns it to User=):
    # an operator running gpu-clean as root must still treat only that user's processes as ours.
    # Anyone else can signal only their own processes: theirs are the ones that count (a pod's
    # `kubectl exec` runs as the daemon's user, in a state directory the kubelet made root's).
    if os.geteuid() != 0:
        return os.getuid()
    try:
        return os.stat(state_dir).st_uid
    except OSError:
        return os.getuid()


def _running_daemon(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        cmd = " ".join(proc.cmdline())
        named = "kimi-serve" in cmd or "supervisor" in cmd
        return named and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _print_gpus(out: TextIO, title: str, gpus: list[dict[str, Any]]) -> None:
    out.write(f"{title}\n  {'GPU':<4} {'UUID':<42} {'USED':>10} {'TOTAL':>10}  PROCESSES\n")
    for g in gpus:
        pids = ",".join(str(p) for p in g["processes"]) or "-"
        out.write(
            f"  {g['index']:<4} {g['uuid']:<42} {_size(g['memory_used_bytes']):>10} "
            f"{_size(g['memory_total_bytes']):>10}  {pids}\n"
        )


def _print_found(out: TextIO, report: CleanReport) -> None:
    if not report.found:
        out.write("Processes: none on the managed GPUs\n")
        return
    out.write(
        f"Processes:\n  {'PID':<8}  {'GPU':<5}  {'MEMORY':>9}  {'KIND':<8}  {'ACTION':<38}  "
        "USER  COMMAND / WHY\n"
    )
    for c in report.found:
        pid = "-" if c.pid is None else str(c.pid)
        gpus = ",".join(str(g) for g in c.gpus) or "-"
        action = report.actions.get(c.pid, "-") if c.pid is not None else "-"
        out.write(
            f"  {pid:<8}  {gpus:<5}  {_size(c.used_bytes):>9}  {c.kind.value:<8}  "
            f"{action:<38}  {c.user or '?'}  {_short(c.cmdline, 70) or '-'}  [{c.reason}]\n"
        )


def run_gpu_clean(cfg: Config, dry_run: bool, out: TextIO, open_nvml: NvmlOpener) -> int:
    """The body of `kimi-serve gpu-clean`: 0 when the managed GPUs are free, else 1."""
    if not cfg.gpus.manage:
        out.write("GPU management is off (gpus.manage: false); nothing to do\n")
        return 0
    store = RecordStore(cfg.state_dir)
    if store.path.exists() and not os.access(store.path, os.R_OK):
        out.write(
            f"warning: cannot read {store.path} (permission); recorded leftovers whose command "
            "line does not match gpus.match will be missed: run as root or the daemon's user\n"
        )
    uid = _daemon_uid(cfg.state_dir)
    read = store.read(uid)
    for line in read.warnings:
        out.write(f"warning: {line}\n")
    record = read.record
    recorded = read.processes
    current: set[ProcessIdentity] = set()
    if record and record.daemon_pid != os.getpid() and _running_daemon(record.daemon_pid):
        out.write(
            f"a kimi-serve daemon (pid {record.daemon_pid}) is running and owns the recorded "
            "processes: reporting only; stop it first to clean\n"
        )
        current = recorded | set(descendants(record.daemon_pid))
        recorded, dry_run = set(), True
    try:
        nvml = open_nvml()
    except NvmlUnavailable as exc:
        out.write(f"error: {exc}\n")
        return 1
    try:
        report = asyncio.run(
            clean(
                cfg.gpus,
                nvml,
                current=current,
                recorded=recorded,
                dry_run=dry_run,
                daemon_uid=uid,
                owner=owner_marker(cfg.state_dir),
            )
        )
    finally:
        nvml.close()
    policy = "dry run" if dry_run else f"policy {cfg.gpus.leftover_policy}"
    devices = "all" if cfg.gpus.devices == "all" else ",".join(map(str, cfg.gpus.devices))
    out.write(
        f"gpus.devices: {devices}; {policy}; processes of uid {uid} matching "
        f"{list(cfg.gpus.match)} count as ours; {len(recorded)} recorded from earlier launches\n"
    )
    if report.before:
        _print_gpus(out, "GPUs before:", report.before)
    _print_found(out, report)
    if report.after and not dry_run:
        _print_gpus(out, "GPUs after:", report.after)
    for w in report.wedged:
        out.write(f"wedged: {w}\n")
    out.write(("ok: " if report.ok else "not clean: ") + report.message + "\n")
    return 0 if report.ok else 1
