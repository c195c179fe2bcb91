"""What the reliability suite watches while it breaks things, and the invariants it checks.

Built on the test kit (`testkit`: the real daemon as a subprocess, its JSON log lines on a
queue, the notify-socket listener). Added here:

- `NotifyListener` (from the kit) as systemd: the daemon sends WATCHDOG=1 from its own event
  loop, so the gaps between those datagrams show whether the loop ever stalled; READY=1
  datagrams show what systemd would have been told.
- `ProcessLog`: every process carrying the daemon's owner marker, keyed by the launch it
  belongs to (the KIMI_SERVE_LAUNCH variable, "<daemon pid>-<launch>"), sampled in a thread and
  from /status, so a launch's processes can be checked after the daemon replaced it.
- the invariants: never ready while decode is broken, nothing of an old launch alive, /status
  and /metrics agree, no traceback in what operators read.
- `trial()`: one line of the table in docs/reliability.md (see tests/reliability/report.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from supervisor.process import LAUNCH_ENV, OWNER_ENV
from testkit import DaemonProcess as Daemon
from testkit import (
    NotifyListener,
    base_config,
    kill_owned,
    owned_processes,
    wait_gone,
)

# systemd's WatchdogSec=1s: the daemon then pings every 0.5 s (half the interval).
WATCHDOG_USEC = 1_000_000
# A loop that misses three pings in a row has stalled (systemd would kill it at 1 s).
MAX_WATCHDOG_GAP_S = 2.0

# Faults under which the launch's decode never works: such a launch must never be called ready.
DECODE_BROKEN = frozenset(
    {"seed-incident", "decode-500", "decode-zero-tokens", "never-ready", "crash-during-load"}
)
_STANDIN_START = re.compile(r"SGLang stand-in \S+ \(launch (\d+); faults: ([^)]*)\)")
CHILD_STATES = frozenset({"launching", "loading", "warming", "ready", "degraded"})


def config(tmp: Path, **overrides: Any) -> dict[str, Any]:
    """harness.base_config with a quicker stand-in (0.1 s load, 0.05 s warm-up) unless the
    overrides set those."""
    given = overrides.get("sglang", {}).get("env", {})
    cfg = base_config(tmp, **overrides)
    env = cfg["sglang"]["env"]
    for name, value in (("STANDIN_LOAD_SECONDS", "0.1"), ("STANDIN_WARMUP_SECONDS", "0.05")):
        if name not in given:
            env[name] = value
    return cfg


def repeat() -> int:
    """Repetitions per fault: 2 in CI, more for a soak (KIMI_SERVE_RELIABILITY_REPEAT)."""
    return max(1, int(os.environ.get("KIMI_SERVE_RELIABILITY_REPEAT", "2")))


def soak_factor() -> int:
    """How much longer a soak runs the bounded tests (KIMI_SERVE_RELIABILITY_SOAK, default 1)."""
    return max(1, int(os.environ.get("KIMI_SERVE_RELIABILITY_SOAK", "1")))


# ------------------------------------------------------------------------------------ report

RESULTS: list[dict[str, Any]] = []


@dataclasses.dataclass
class Trial:
    """One run of one injected fault, as the report counts it."""

    category: str
    case: str
    recovered: bool = False
    false_ready: int = 0
    orphans: int = 0
    tracebacks: int = 0
    known_bug: str = ""
    passed: bool = False
    seconds: float = 0.0
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def trial(category: str, case: str, known_bug: str = "") -> Iterator[Trial]:
    t = Trial(category, case, known_bug=known_bug)
    start = time.monotonic()
    try:
        yield t
        t.passed = True
    finally:
        t.seconds = round(time.monotonic() - start, 2)
        RESULTS.append(dataclasses.asdict(t))


# ------------------------------------------------------------------------ systemd's socket


# -------------------------------------------------------------------- processes per launch


def _label(value: str | None) -> tuple[int, int] | None:
    try:
        pid, launch = (value or "").split("-")
        return int(pid), int(launch)
    except ValueError:
        return None


class ProcessLog:
    """Every process of ours seen so far, by (daemon pid, launch)."""

    def __init__(self, owner: str, interval: float = 0.05) -> None:
        self.owner = owner
        self.interval = interval
        self.by_launch: dict[tuple[int, int], dict[int, psutil.Process]] = {}
        self._checked: set[tuple[int, float]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def sample(self) -> None:
        now = time.time()
        for proc in psutil.process_iter(["pid", "create_time"]):
            created = proc.info["create_time"] or 0.0
            key = (proc.pid, created)
            if key in self._checked:
                continue
            with contextlib.suppress(psutil.Error):
                env = proc.environ()
                label = _label(env.get(LAUNCH_ENV)) if env.get(OWNER_ENV) == self.owner else None
                if label is not None:
                    self._add(label, proc)
                # A process caught between fork and exec still has its parent's environment:
                # look again while it is young.
                if label is not None or now - created > 1.0:
                    self._checked.add(key)

    def _add(self, label: tuple[int, int], proc: psutil.Process) -> None:
        with self._lock:
            self.by_launch.setdefault(label, {}).setdefault(proc.pid, proc)

    def add_status(self, daemon_pid: int, status: dict[str, Any]) -> None:
        """Record the child tree /status reports for its launch."""
        child = status.get("child")
        if not child:
            return
        for pid in child.get("processes", []):
            with contextlib.suppress(psutil.Error):
                self._add((daemon_pid, int(child["launch"])), psutil.Process(pid))

    def launch(self, label: tuple[int, int]) -> list[psutil.Process]:
        with self._lock:
            return list(self.by_launch.get(label, {}).values())

    def alive(self, which: Callable[[tuple[int, int]], bool]) -> list[tuple[tuple[int, int], int]]:
        """(label, pid) of processes still alive among the launches `which` selects."""
        with self._lock:
            items = [
                (lab, p)
                for lab, procs in self.by_launch.items()
                if which(lab)
                for p in procs.values()
            ]
        return [(lab, p.pid) for lab, p in items if is_alive(p)]


def is_alive(proc: psutil.Process) -> bool:
    """Running and the same process (psutil checks the create time); a zombie is dead."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# ------------------------------------------------------------------------------ the daemon


@dataclasses.dataclass
class Run:
    """One daemon process and everything watching it."""

    d: Daemon
    notify: NotifyListener
    procs: ProcessLog
    started: float
    # False for a daemon that was SIGKILLed and replaced: its successor (same owner marker)
    # cleans up, and the owner-wide leftover check belongs to the successor.
    check_leftovers: bool = True

    @property
    def pid(self) -> int:
        return self.d.proc.pid

    def status(self) -> dict[str, Any]:
        doc = self.d.status()
        self.procs.add_status(self.pid, doc)
        return doc

    def events(self) -> list[dict[str, Any]]:
        self.d.states()  # moves queued events into d.seen
        return list(self.d.seen)

    def kill_sglang(self, sig: int = 9) -> tuple[dict[str, Any], float]:
        """Send `sig` to SGLang's main process; (its /status child entry, unix time sent)."""
        child = self.status()["child"]
        assert child, "no SGLang child to kill"
        at = time.time()
        os.kill(child["pid"], sig)
        return child, at


def write_config(path: Path, cfg: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(yaml.safe_dump(cfg))
    os.replace(tmp, path)


@contextlib.contextmanager
def supervised(
    tmp: Path,
    cfg: dict[str, Any],
    t: Trial | None = None,
    *,
    env: dict[str, str] | None = None,
    name: str = "kimi-serve.yaml",
    preexec: Callable[[], None] | None = None,
) -> Iterator[Run]:
    """The daemon under a fake systemd notify socket with WatchdogSec=1s.

    On exit: stop it (SIGTERM), then prove that nothing carrying its owner marker is alive and
    that no traceback reached its output; both go into the trial's counts.
    """
    path = tmp / name
    write_config(path, cfg)
    listener = NotifyListener()
    full_env = {**os.environ, **(env or {})}
    full_env.pop("WATCHDOG_PID", None)
    full_env["NOTIFY_SOCKET"] = listener.address
    full_env["WATCHDOG_USEC"] = str(WATCHDOG_USEC)
    d = Daemon.start(path, cfg, full_env, preexec_fn=preexec)
    proc = d.proc
    procs = ProcessLog(d.owner)
    run = Run(d, listener, procs, time.monotonic())
    try:
        yield run
    finally:
        try:
            if proc.poll() is None:
                d.stop()
            if d.reader is not None:
                d.reader.join(5)
        finally:
            procs.close()
            listener.close()
            left: list[psutil.Process] = []
            if run.check_leftovers:
                left = wait_gone(owned_processes(d.owner), timeout=5)
                kill_owned(d.owner)
            shown = operator_tracebacks(d.raw)
            if t is not None:
                t.orphans += len(left)
                t.tracebacks += len(shown)
        assert not left, f"processes left behind: {[p.pid for p in left]}"
        assert not shown, f"a traceback reached the daemon's own output: {shown[:3]}"


def operator_tracebacks(raw: list[str]) -> list[str]:
    """Daemon output lines (not SGLang's, which are forwarded on purpose) with a traceback."""
    found = []
    for line in raw:
        try:
            doc = json.loads(line)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            if doc.get("source") == "sglang":
                continue
            # The restart record quotes SGLang's last lines (its traceback included) on
            # purpose: that is SGLang's output, not the daemon's.
            doc.pop("log_tail", None)
            line = json.dumps(doc)
        if "Traceback" in line:
            found.append(line.strip()[:300])
    return found


def event_time(ev: dict[str, Any]) -> float:
    """Unix time of a daemon log event (its ISO timestamp)."""
    return datetime.fromisoformat(str(ev["timestamp"]).replace("Z", "+00:00")).timestamp()


def is_state(new: str, reason: str | None = None) -> Callable[[dict[str, Any]], bool]:
    def pred(ev: dict[str, Any]) -> bool:
        return (
            ev.get("event") == "state"
            and ev.get("new") == new
            and ev.get("old") != new
            and (reason is None or ev.get("reason") == reason)
        )

    return pred


def is_event(prefix: str) -> Callable[[dict[str, Any]], bool]:
    return lambda ev: str(ev.get("event", "")).startswith(prefix)


# ---------------------------------------------------------------------------- invariants


@dataclasses.dataclass
class Segment:
    """The daemon's events from one "launching" to the next: one launch of SGLang."""

    launch: int  # the daemon's launch number (1-based, per daemon process)
    faults: frozenset[str] | None = None  # what the stand-in said it injects; None: unknown
    states: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def new_states(self) -> list[str]:
        return [e["new"] for e in self.states if e["new"] != e["old"]]

    @property
    def restart(self) -> dict[str, Any] | None:
        return next((e for e in self.states if e["new"] == "restarting"), None)

    @property
    def was_ready(self) -> bool:
        return "ready" in self.new_states


def segments(events: list[dict[str, Any]]) -> list[Segment]:
    out: list[Segment] = []
    for ev in events:
        if ev.get("event") == "state":
            if ev.get("new") == "launching" and ev.get("old") != "launching":
                out.append(Segment(len(out) + 1))
            if out:
                out[-1].states.append(ev)
        elif out and ev.get("source") == "sglang" and out[-1].faults is None:
            m = _STANDIN_START.search(str(ev.get("event", "")))
            if m:
                names = m.group(2).strip()
                out[-1].faults = frozenset(
                    () if names == "none" else (n.strip() for n in names.split(","))
                )
    return out


def false_ready(segs: list[Segment]) -> list[Segment]:
    """Launches whose decode was broken from the start, yet which were called ready."""
    return [s for s in segs if s.faults and s.faults & DECODE_BROKEN and s.was_ready]


def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def disagreements(admin: str, tries: int = 10) -> list[str]:
    """What /status and /metrics disagree on (state, readiness, restarts per reason).

    The two are read one after the other, so a state change in between is retried: /status is
    read on both sides of /metrics and only a stable pair is compared.
    """
    with httpx.Client(timeout=5, trust_env=False) as client:
        for _ in range(tries):
            before = client.get(admin + "/status").json()
            metrics = metric_samples(client.get(admin + "/metrics").text)
            after = client.get(admin + "/status").json()
            if (before["state"], before["restarts"]) != (after["state"], after["restarts"]):
                continue
            problems = []
            on = [lab["state"] for lab, v in metrics.get("kimi_serve_state", []) if v == 1]
            if on != [before["state"]]:
                problems.append(f"/status state {before['state']!r}, metrics say {on}")
            value = metrics.get("kimi_serve_ready", [({}, -1.0)])[0][1]
            expected = 1.0 if before["state"] in ("ready", "degraded") else 0.0
            if value != expected:
                problems.append(f"kimi_serve_ready {value:g} in state {before['state']}")
            counted = {lab["reason"]: v for lab, v in metrics.get("kimi_serve_restarts_total", [])}
            for reason in set(counted) | set(before["restarts"]):
                want = float(before["restarts"].get(reason, 0))
                if counted.get(reason, 0.0) != want:
                    problems.append(
                        f"restarts[{reason}]: /status {want:g}, metrics {counted.get(reason)}"
                    )
            return problems
    return ["/status kept changing while /metrics was read"]


def stale_processes(run: Run, state: str, launch: int | None) -> list[tuple[tuple[int, int], int]]:
    """Processes alive although the daemon, in `state` with child launch `launch`, is past them.

    Only asked in states where a child runs: then every earlier launch of this daemon, and
    every launch of an earlier daemon on the same state directory, must be gone. (A launch
    newer than the /status read may have started since; it is not stale.)
    """
    if state not in CHILD_STATES or launch is None:
        return []
    me = run.pid
    return run.procs.alive(lambda lab: lab[0] != me or lab[1] < launch)
