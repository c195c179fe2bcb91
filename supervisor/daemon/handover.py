"""Hand-over: the daemon execs a fresh kimi-serve under its own PID and SGLang keeps serving.

`POST /reexec` (or `kimi-serve reexec`) → `Handover.begin` → `execute`: the launch's pipes are
no longer read (`ProcessOwner.release`: what is still in a pipe stays there, the partial line
read goes into the state), the state is written to a memfd, the memfd, the pipes and the admin
listening socket are made inheritable (Python opens every descriptor close-on-exec), systemd is
told `RELOADING=1`, every signal the daemon handles is blocked (`SIGNALS`: SIGTERM, SIGINT,
SIGHUP, SIGUSR1 and the others of daemon/signals.py; the mask survives the exec: a stop, or any
of them, in that window waits for the new daemon's handlers instead of killing the daemon, and
SGLang with it), and the same interpreter execs the installed kimi-serve with the same arguments.

The new daemon (supervisor/daemon/adoption.py; `take` at the start of `Daemon.run`): the
memfd's number comes in
`KIMI_SERVE_HANDOVER_FD`, which is removed from the environment at once (SGLang must not inherit
it). The state is trusted only when the descriptor is a memfd of ours and the state names this
PID and this boot: a variable left in an environment by anything else is ignored. The admin
endpoint serves on the inherited listening socket, so a client never sees a refused connection;
preflight is skipped; `adopt` verifies each process and pipe (process.adopt.verify) and resumes
the pump on the same pipes with the partial line; the machine's context comes back as it was
(state, launch number, profile, the crash-loop window's restarts, its trial clock): a
hand-over is neither a launch nor a restart. A liveness decode probe follows at once, and
READY=1 once it answered. Anything that does not verify falls back to the ordinary path: the
log says why, and the start cleans the host of the old launch (the launch record) and launches.

Only a serving daemon hands over (`ready`, `degraded`, `draining`): during a load the request
is refused, and so is a multi-node replica's (docs/architecture.md, "Hand-over").
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from supervisor import __version__, log
from supervisor.core import events as ev
from supervisor.core.states import State
from supervisor.daemon import signals, upgrades
from supervisor.process import Child
from supervisor.process.adopt import pipe_inode
from supervisor.process.identity import current_boot_id, live_process
from supervisor.sglang.logscan import Stream

if TYPE_CHECKING:
    from collections.abc import Callable

    from supervisor.admin import Served
    from supervisor.config import Config
    from supervisor.daemon.inbox import Item
    from supervisor.daemon.notify import Notifier
    from supervisor.daemon.upgrades import Upgrades
    from supervisor.daemon.wiring import Parts
    from supervisor.metrics import Metrics
    from supervisor.router import RouterLink


class Daemon(Protocol):
    """What a hand-over reads and drives of the daemon (daemon.loop.Daemon)."""

    cfg: Config
    parts: Parts
    notifier: Notifier
    metrics: Metrics
    log: Any
    handover: Handover
    upgrades: Upgrades
    admin_served: Served | None
    clock: Callable[[], float]

    @property
    def router(self) -> RouterLink | None: ...
    def emit(self, item: Item) -> None: ...
    def status_line(self) -> str: ...


ENV = "KIMI_SERVE_HANDOVER_FD"
MEMFD_NAME = "kimi-serve-handover"
DIGEST_ENV = "KIMI_SERVE_HANDOVER_SHA256"  # the state's SHA-256, checked by the new daemon
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
PR_SET_DUMPABLE = 4
FORMAT = 1
# Every signal the daemon handles (daemon/signals.py): blocked from just before the exec until
# the new daemon has set its handlers, so none meets SIG_DFL in between.
SIGNALS = signals.HANDLED
SERVING = frozenset({State.READY, State.DEGRADED, State.DRAINING})
# Internal errors handed over (Handover.recover): at most this many within the window.
RECOVER_MAX = 3
RECOVER_WINDOW_S = 3600.0
INTERNAL_ERROR = "internal_error"  # the incident's reason
OUTCOMES = ("ok", "fallback", "failed")

# The machine's context fields that travel; the rest start afresh (a probe in flight is not
# carried: the new daemon probes at once).
_CTX_FIELDS = (
    "state",
    "since",
    "profile",
    "launch",
    "launched_at",
    "ready_at",
    "liveness_failures",
    "backoff",
    "ever_ready",
    "canary_at",
)


@dataclass
class Handover:
    """The daemon's own run: its version, when it started, the hand-overs behind it."""

    daemon: Daemon
    started_at: float = field(default_factory=time.time)
    handoffs: int = 0
    last: dict[str, Any] | None = None
    begun: bool = False
    recoveries: list[float] = field(default_factory=list)  # wall times, carried over the exec
    # kimi_serve_handoffs_total by outcome, carried over the exec: a counter the new program
    # started at 0 would show a second hand-over as 1 -> 1, which no increase() sees.
    counted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    # The internal error a hand-over under way recovers from (`recover`): if the exec does not
    # happen after all, the old path follows (a clean stop, exit 1).
    cause: BaseException | None = None
    # Set by `adopt` until the adopted launch's first decode answered: then READY=1.
    awaiting_probe: float | None = None
    probe_error: str | None = None  # the adopted launch's last failed probe, while awaiting
    _exec_at: float | None = None
    _from_version: str | None = None

    def refusal(self) -> str | None:
        """Why a hand-over cannot be done now (POST /reexec answers 409), or None."""
        d = self.daemon
        ctx = d.parts.machine.ctx
        if self.begun:
            return "a hand-over is already under way"
        if ctx.state not in SERVING:
            return (
                f"the daemon hands over only while serving (ready, degraded, draining); "
                f"it is {ctx.state.value}: try again once ready, or use restart"
            )
        if d.parts.group is not None:
            return "a multi-node replica does not hand over (group): use restart"
        child = d.parts.launcher.child
        if child is None or not child.alive() or child.stop_begun:
            return "SGLang is not running"
        if self.awaiting_probe is not None:
            return "the last hand-over is still probing SGLang"
        stuck = stuck_threads()
        if stuck:
            return f"threads {stuck} are stuck in the kernel (D state): the exec would hang"
        return None

    def recover(self, exc: BaseException) -> bool:
        """An internal error of the daemon's own code: hand over to a fresh exec (which adopts
        SGLang) rather than stop it, at most RECOVER_MAX times within RECOVER_WINDOW_S (then
        the old path: a clean stop, exit 1). Recorded as an incident with the traceback."""
        now = time.time()
        self.recoveries = [t for t in self.recoveries if now - t < RECOVER_WINDOW_S]
        refused = self.refusal()
        if refused is None and len(self.recoveries) >= RECOVER_MAX:
            refused = f"{RECOVER_MAX} hand-overs after internal errors within {RECOVER_WINDOW_S:g}s"
        trace = "".join(traceback.format_exception(exc)).rstrip().splitlines()
        p = self.daemon.parts
        written = p.recorder.record(
            INTERNAL_ERROR,
            f"{type(exc).__name__}: {exc}"[:300],
            None,
            None,
            [*p.pump.tail(), "--- the daemon's traceback ---", *trace],
            p.observed.gpu_status(),
        )
        p.observed.incident_written(written)
        if refused is not None:
            self.daemon.log.warning("internal error not handed over", why=refused)
            return False
        self.recoveries.append(now)
        self.cause = exc
        self.begin()
        return True

    def begin(self) -> None:
        # Called once the answer is on its way; `execute` lets the admin requests in flight be
        # answered before the exec.
        self.begun = True
        self.daemon.parts.inbox.spawn(execute(self.daemon))

    def status(self) -> dict[str, Any]:
        """`/status.daemon`."""
        return {
            "version": __version__,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "handoffs": self.handoffs,
            "last_handoff": self.last,
        }

    def ended(self, outcome: str, seconds: float | None, why: str | None = None) -> None:
        """`last_handoff` and the counter: `ok` adopted, `fallback` relaunched, `failed` no
        exec (`why` says why for the last two; `reexec --wait` prints it)."""
        self.last = {
            "at": time.time(),
            "seconds": None if seconds is None else round(seconds, 3),
            "from_version": self._from_version,
            "outcome": outcome,
            "why": why,
        }
        self.counted[outcome] = self.counted.get(outcome, 0) + 1
        self.daemon.metrics.handoffs.labels(outcome).inc()

    def carried(self, counted: object) -> None:
        """The counts an earlier exec passed on, into this program's counter."""
        if not isinstance(counted, dict):
            return
        for outcome in OUTCOMES:
            n = counted.get(outcome)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                self.counted[outcome] += n
                self.daemon.metrics.handoffs.labels(outcome).inc(n)

    def not_begun(self, why: str) -> None:
        """The exec did not happen after all (the request was answered 202): `failed`, with
        why; after an internal error the old path follows."""
        self.begun = False
        self.ended("failed", None, why)
        cause, self.cause = self.cause, None
        if cause is not None:
            self.daemon.log.error("internal error not handed over; stopping", why=why)
            self.daemon.parts.inbox.failed()
            self.daemon.emit(ev.StopRequested("internal-error"))


# ------------------------------------------------------------------ the old daemon


Pipes = dict[Stream, tuple[int, bytes]]


def state_of(d: Daemon, child: Child, pipes: Pipes, admin_fd: int) -> dict[str, Any]:
    ctx = d.parts.machine.ctx
    quality = d.parts.quality.cur
    link = d.router
    return {
        "format": FORMAT,
        "pid": os.getpid(),
        "boot_id": current_boot_id(),
        "version": __version__,
        "mono": time.monotonic(),
        "started_at": d.handover.started_at,
        "handoffs": d.handover.handoffs,
        "counted": d.handover.counted,
        "counters": d.metrics.counters(),
        "recoveries": d.handover.recoveries,
        "machine": {
            **{name: getattr(ctx, name) for name in _CTX_FIELDS},
            "restarts": list(ctx.restarts),
        },
        "child": {
            "pid": child.pid,
            "create_time": child.identity.create_time,
            "started_at": child.started_at,
            # Only those alive now: `known` keeps every process ever seen, helpers that
            # ended by design among them (`ldconfig -p`, a compiler).
            "known": [[i.pid, i.create_time] for i in sorted(child.known) if live_process(i)],
            "argv": list(d.parts.launcher.spec.argv),
        },
        "pipes": {
            stream.value: {
                "fd": fd,
                "inode": pipe_inode(fd),
                "partial": base64.b64encode(partial).decode("ascii"),
            }
            for stream, (fd, partial) in pipes.items()
        },
        "admin_fd": admin_fd,
        "router_worker_id": None if link is None else link.state.worker_id,
        "sglang_version": d.parts.observed.sglang_version,
        "observed": d.parts.observed.carried(),
        "upgrade": upgrades.carried(ctx, d.upgrades),
        "quality": None
        if quality is None
        else {
            "canary": quality.canary,
            "key": quality.key,
            "identity": quality.identity,
            "version": quality.version,
        },
    }


def _memfd(doc: dict[str, Any]) -> tuple[int, str]:
    """The state on a sealed memfd, and its digest (passed beside it in DIGEST_ENV). Sealed
    (`SEALS`: no write, no growing, no shrinking, no more seals): a process of the same user
    that opens it through /proc/<pid>/fd during the exec can read it, never change it."""
    fd = os.memfd_create(MEMFD_NAME, os.MFD_ALLOW_SEALING)  # no MFD_CLOEXEC: for the exec
    try:
        data = json.dumps(doc).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, hashlib.sha256(data).hexdigest()


def _not_dumpable() -> None:
    """PR_SET_DUMPABLE 0 until the exec (which resets it): /proc/<pid>/fd of this process is
    then root's alone, so no process of the service user (SGLang) opens the state meanwhile."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


async def execute(d: Daemon) -> None:
    """The exec. Returns only if it did not happen: then everything is as it was, the log
    says why."""
    ho, served = d.handover, d.admin_served
    if served is None or served.hand_over is None or served.resume is None:
        why = "the admin endpoint is not serving"
        d.log.warning("hand-over not begun", why=why)
        ho.not_begun(why)
        return
    admin_fd = await served.hand_over()
    # From here a stop or a reload waits, blocked, for the new daemon's handlers. One that
    # came just before is already queued as an event the exec would drop: then no hand-over.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    for _ in range(2):  # the signal's handler, then the callback it scheduled
        await asyncio.sleep(0)
    refused = _still_refused(d) or _signalled(d)  # the state may have moved on meanwhile
    child = d.parts.launcher.child
    if refused is not None or child is None:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        await served.resume(admin_fd)
        why = refused or "SGLang is not running"
        d.log.warning("hand-over not begun", why=why)
        ho.not_begun(why)
        return
    log.get().info("hand-over: exec", version=__version__, sglang_pid=child.pid)
    pipes = d.parts.launcher.owner.release(child)
    memfd = -1
    try:
        memfd, digest = _memfd(state_of(d, child, pipes, admin_fd))
        passed = [memfd, admin_fd, *(fd for fd, _ in pipes.values())]
        for fd in passed:
            os.set_inheritable(fd, True)
        d.notifier.reloading()
        d.notifier.status(f"handing over to a fresh exec of kimi-serve (pid {os.getpid()})")
        env = {**os.environ, ENV: str(memfd), DIGEST_ENV: digest}
        sys.stdout.flush()
        sys.stderr.flush()
        _not_dumpable()
        os.execve(sys.executable, sys.orig_argv, env)
    except Exception as exc:  # an exec refused (ENOMEM, E2BIG) or a state not written
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for fd, _ in pipes.values():
            os.set_inheritable(fd, False)
        if memfd >= 0:
            os.close(memfd)
        d.parts.launcher.owner.own(child, pipes)
        os.set_inheritable(admin_fd, False)
        await served.resume(admin_fd)
        d.log.error("hand-over failed: the exec did not happen", error=repr(exc))
        d.notifier.ready(d.status_line())
        ho.not_begun(f"the exec did not happen: {exc!r}")


def _signalled(d: Daemon) -> str | None:
    """A stop or reload already queued: the exec would lose it."""
    queued = []
    while not d.parts.inbox.queue.empty():
        queued.append(d.parts.inbox.queue.get_nowait())
    for item in queued:
        d.parts.inbox.queue.put_nowait(item)  # in order, untouched: the hand-over may not happen
    for item in queued:
        if isinstance(item, ev.StopRequested | ev.ReloadRequested):
            return f"a {type(item).__name__} came first"
    return None


def stuck_threads(task_dir: str = "/proc/self/task") -> list[int]:
    """Threads of this process in uninterruptible sleep (D state: NVML, a hung mount): the
    kernel waits for them before an exec completes, so a hand-over would hang on them."""
    stuck = []
    for tid in os.listdir(task_dir):
        with contextlib.suppress(OSError):
            with open(f"{task_dir}/{tid}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
            if raw[raw.rfind(")") + 2 :].split()[:1] == ["D"]:
                stuck.append(int(tid))
    return stuck


def _still_refused(d: Daemon) -> str | None:
    # Between the answer and this turn of the loop the state may have moved on.
    ho = d.handover
    ho.begun = False
    try:
        return ho.refusal()
    finally:
        ho.begun = True
