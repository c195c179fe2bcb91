"""GPU hygiene, the pure layer: what every process on our GPUs is.

From NVML's view (`supervisor.gpu.nvml`), each process's psutil facts (`ProcFacts`, gathered by
`supervisor.gpu.clean.gather_facts`) and what this daemon launched, `classify()` decides what
every process on our GPUs is. Only our own leftovers are ever signalled (by
`supervisor.gpu.clean.clean()`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import psutil

from supervisor.gpu.nvml import GpuSnapshot
from supervisor.process.identity import (
    CREATE_TIME_SLACK,
    OWNER_ENV,
    ProcessIdentity,
    launch_leader,
    same_start,
)

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
