"""Hand-over, the new daemon's side: the state an earlier exec passed on (`take`), the adoption
of SGLang it describes or the fallback to a relaunch (`adopt`), READY=1 after the first decode
(`probed`), and the stop of an inherited SGLang when the new daemon cannot start (`abandon`).
The old daemon's side, and why each step is there: supervisor/daemon/handover.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import psutil

from supervisor import log, router
from supervisor.core import events as ev
from supervisor.core.context import Context
from supervisor.core.states import State, TimerName
from supervisor.daemon import upgrades
from supervisor.daemon.handover import (
    DIGEST_ENV,
    ENV,
    FORMAT,
    MEMFD_NAME,
    SEALS,
    SERVING,
    Daemon,
    Pipes,
)
from supervisor.process import Child
from supervisor.process.adopt import Adopted, Pipe, Unverifiable, verify
from supervisor.process.identity import ProcessIdentity, live_process
from supervisor.sglang import argv
from supervisor.sglang.argv import LaunchSpec
from supervisor.sglang.logscan import Stream

# A state is a few KiB to a few MiB (the pipes' partial lines, the last restart's log tail):
# this bounds what a descriptor under the variable's number could make the new daemon read.
MAX_STATE_BYTES = 256 << 20


@dataclass(frozen=True)
class Inherited:
    doc: dict[str, Any]
    admin: socket.socket | None


def take() -> Inherited | None:
    """The state an earlier exec of this daemon passed on, or None (a start, or a state that
    is not ours: logged). Removes the variable from the environment either way."""
    raw = os.environ.pop(ENV, None)
    digest = os.environ.pop(DIGEST_ENV, None)
    if raw is None:
        return None
    try:
        fd = int(raw)
        link = os.readlink(f"/proc/self/fd/{fd}")
    except (ValueError, OSError):
        log.get().warning("hand-over state ignored", why=f"{ENV}={raw!r} names no descriptor")
        return None
    if not link.startswith(f"/memfd:{MEMFD_NAME}"):
        log.get().warning("hand-over state ignored", why=f"fd {fd} is {link}, not a hand-over")
        return None
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & SEALS != SEALS:
        os.close(fd)
        log.get().warning("hand-over state ignored", why=f"fd {fd} is not sealed")
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_STATE_BYTES + 1)
        if len(data) > MAX_STATE_BYTES:
            raise ValueError(f"over {MAX_STATE_BYTES} bytes")
        if digest is None or hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"its SHA-256 is not the one in {DIGEST_ENV}")
        doc = json.loads(data)
    except (OSError, ValueError, RecursionError) as exc:
        log.get().warning("hand-over state ignored", why=f"unreadable: {exc!r}")
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("pid") != os.getpid():
        log.get().warning("hand-over state ignored", why="not written for this process")
        return None
    return Inherited(doc, _admin_socket(doc.get("admin_fd")))


def abandon(why: str, *, grace: float = 30.0) -> list[int]:
    """The new daemon cannot start after a hand-over (its config or token file is refused:
    exit 78): nobody would own the inherited SGLang, so it is stopped rather than orphaned.
    Only the processes the state names that are still the same ones (pid and start time) are
    signalled: SIGTERM, then SIGKILL after `grace`. Returns the pids signalled (none without a
    state of ours)."""
    got = take()
    if got is None:
        return []
    child = got.doc.get("child")
    named: list[Any] = []
    if isinstance(child, dict):
        named = [[child.get("pid"), child.get("create_time")], *(child.get("known") or [])]
    procs = []
    for entry in named:
        if not (isinstance(entry, list) and len(entry) == 2):
            continue
        pid, created = entry
        if isinstance(pid, int) and isinstance(created, int | float):
            proc = live_process(ProcessIdentity(pid, float(created)))
            if proc is not None and proc not in procs:
                procs.append(proc)
    log.get().error(
        "hand-over abandoned: stopping the inherited SGLang", why=why, pids=[p.pid for p in procs]
    )
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in procs]


def _admin_socket(fd: Any) -> socket.socket | None:
    if not isinstance(fd, int) or fd < 0:
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        log.get().warning("hand-over: admin socket not inherited", fd=fd, error=str(exc))
        return None
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 1:
            raise OSError("not a listening socket")
    except OSError as exc:
        sock.close()
        log.get().warning("hand-over: admin socket not inherited", fd=fd, error=str(exc))
        return None
    sock.set_inheritable(False)
    return sock


def inherited_version(got: Inherited | None) -> str | None:
    """SGLang's version as the old daemon knew it: preflight is skipped on a hand-over."""
    if got is None:
        return None
    return str(got.doc.get("sglang_version") or "unknown")


def adopt(d: Daemon, got: Inherited) -> bool:
    """Take over the launch `got` describes; False when it fell back (then emit Start)."""
    doc, ho = got.doc, d.handover
    ho._from_version = str(doc.get("version"))
    ho.handoffs = int(doc.get("handoffs") or 0) + 1
    ho.started_at = float(doc.get("started_at") or ho.started_at)
    ho.recoveries = [float(t) for t in doc.get("recoveries") or []]
    try:
        child, pipes, m = _verified(d, doc)
    except (Unverifiable, KeyError, ValueError, TypeError, AttributeError) as exc:
        why = str(exc) if isinstance(exc, Unverifiable) else f"state unreadable: {exc!r}"
        _fall_back(d, doc, why)
        return False
    upgrades.restore(d.parts.machine.ctx, d.upgrades, doc.get("upgrade"))
    spec = _expected(d, doc, str(m["profile"]))
    d.parts.launcher.adopted(child, spec, m["profile"])
    d.parts.launcher.owner.own(child, pipes)
    d.parts.launcher.owner.refresh_tree(child)
    d.parts.pump.new_launch()
    now = d.clock()
    d.parts.recorder.launched(child.launch, m["profile"], now)
    d.parts.quality.launched(child.launch, spec)
    quality, cur = doc.get("quality"), d.parts.quality.cur
    if isinstance(quality, dict) and cur is not None:
        cur.canary = dict(quality.get("canary") or cur.canary)
        cur.key, cur.identity = quality.get("key"), quality.get("identity")
        cur.version = quality.get("version")
    _restore(d.parts.machine.ctx, m)
    ctx = d.parts.machine.ctx  # the gauges of the trial as they were, not a fresh start's
    d.metrics.trial.set(1 if ctx.trial else 0)
    d.metrics.lkg_serving.set(1 if ctx.on_lkg else 0)
    d.parts.observed.adopted(child, doc.get("observed"))
    d.parts.observed.profile(None, d.parts.machine.ctx.profile)
    link = d.router
    if link is not None and d.parts.machine.ctx.state is not State.DRAINING:
        link.state.worker_id = doc.get("router_worker_id")
        router.carry_out(link, ev.RouterRegister(child.launch))
    ho.awaiting_probe = float(doc["mono"])
    d.log.info(
        "hand-over: SGLang adopted",
        sglang_pid=child.pid,
        launch=child.launch,
        state=d.parts.machine.ctx.state.value,
        from_version=ho._from_version,
    )
    # The decode probe, now (the machine's liveness timer, fired early).
    d.emit(ev.TimerFired(TimerName.LIVENESS, child.launch))
    return True


def probed(d: Daemon) -> None:
    """The adopted launch's first decode answered: READY=1 ends systemd's reload job."""
    ho = d.handover
    if ho.awaiting_probe is None:
        return
    seconds = time.monotonic() - ho.awaiting_probe
    ho.awaiting_probe = None
    ho.probe_error = None
    ho.ended("ok", seconds)
    d.log.info(
        "hand-over complete", seconds=round(seconds, 3), state=d.parts.machine.ctx.state.value
    )
    d.notifier.ready(d.status_line())


def probe_failed(d: Daemon, why: str) -> None:
    """A decode probe of the adopted launch failed before any succeeded: the hand-over is not
    complete (liveness's own threshold decides about SGLang); kept for `relaunched`."""
    ho = d.handover
    if ho.awaiting_probe is None:
        return
    ho.probe_error = why
    d.log.warning("hand-over: the adopted launch's decode probe failed", error=why)


def relaunched(d: Daemon) -> None:
    """SGLang was launched anew before the adopted launch answered a decode probe: the hand-over
    fell back to a restart (counted so; READY=1 ends systemd's reload job)."""
    ho = d.handover
    if ho.awaiting_probe is None:
        return
    seconds = time.monotonic() - ho.awaiting_probe
    ho.awaiting_probe = None
    why = "the adopted SGLang never answered a decode probe; it was restarted"
    if ho.probe_error:
        why = f"{why} (last probe: {ho.probe_error})"
    ho.probe_error = None
    ho.ended("fallback", seconds, why)
    d.log.warning("hand-over fell back to a restart", why=why)
    d.notifier.ready(d.status_line())


def _expected(d: Daemon, doc: dict[str, Any], profile: str) -> LaunchSpec:
    """What the running launch must be: after a rollback the last known good's command (the
    trusted one the state carries), else what the configuration builds."""
    carried = doc.get("upgrade")
    if isinstance(carried, dict) and carried.get("on_lkg") is True:
        trusted = upgrades.trusted_of(carried).get(profile)
        if trusted is not None:
            return trusted
    return argv.build(d.cfg, profile)


def _verified(d: Daemon, doc: dict[str, Any]) -> tuple[Child, Pipes, dict[str, Any]]:
    c, m = doc["child"], doc["machine"]
    main = ProcessIdentity(int(c["pid"]), float(c["create_time"]))
    known = {ProcessIdentity(int(p), float(t)) for p, t in c["known"]}
    pipes = {
        Stream(name): Pipe(int(p["fd"]), int(p["inode"]), base64.b64decode(p["partial"]))
        for name, p in doc["pipes"].items()
    }
    try:
        if set(pipes) != {Stream.STDOUT, Stream.STDERR}:
            raise Unverifiable("the state does not name both of SGLang's output pipes")
        verify(main, doc.get("boot_id"), known - {main}, {s.value: p for s, p in pipes.items()})
        if State(m["state"]) not in SERVING:
            raise Unverifiable(f"the launch was {m['state']}, not serving")
        if d.parts.group is not None:
            raise Unverifiable("a multi-node replica does not hand over (group)")
        spec = _expected(d, doc, str(m["profile"]))
        if list(spec.argv) != list(c["argv"]):
            raise Unverifiable(
                f"the configuration changes SGLang's command line ({d.cfg.path}): relaunching"
            )
    except BaseException:
        for p in pipes.values():
            _close(p.fd)
        raise
    child = Child(
        launch=int(m["launch"]),
        popen=Adopted(main.pid),
        identity=main,
        started_at=float(c["started_at"]),
        known=known | {main},
    )
    return child, {s: (p.fd, p.partial) for s, p in pipes.items()}, m


def _restore(ctx: Context, m: dict[str, Any]) -> None:
    ctx.state = State(m["state"])
    ctx.since = float(m["since"])
    ctx.profile = str(m["profile"])
    ctx.launch = int(m["launch"])
    ctx.child = True
    ctx.launched_at = m["launched_at"]
    ctx.ready_at = m["ready_at"]
    ctx.liveness_failures = int(m["liveness_failures"])
    ctx.backoff = float(m["backoff"])
    ctx.ever_ready = bool(m["ever_ready"])
    ctx.canary_at = m["canary_at"]
    ctx.restarts = deque(float(t) for t in m["restarts"])


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _fall_back(d: Daemon, doc: dict[str, Any], why: str) -> None:
    """The ordinary path: the start that follows cleans the old launch away (its launch
    record, its session, the owner marker) and launches anew. The old main process is still
    our child: it is reaped once it dies, so no zombie stays."""
    d.log.warning("hand-over: cannot adopt SGLang; stopping it and relaunching", why=why)
    d.handover.ended("fallback", None, why)
    m = doc.get("machine")
    if isinstance(m, dict) and isinstance(m.get("launch"), int):
        d.parts.machine.ctx.launch = m["launch"]  # launch numbers go on, as after a restart
    for proc in psutil.Process().children():
        reap_when_dead(proc.pid)


def reap_when_dead(pid: int) -> None:
    """Reap an inherited child (a process the earlier exec spawned) once it exits."""
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return

    def readable() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)

    loop.add_reader(pidfd, readable)
