"""Stray signals against the real daemon and the stand-in: each one that would end the daemon
by default (and under the unit's KillMode=mixed SGLang with it) is logged and changes nothing;
SIGUSR1 puts the daemon's own stacks in the log."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from testkit import base_config, running, wait_until
from testkit.daemon import DaemonProcess

pytestmark = pytest.mark.timeout(90)

STRAYS = (
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGVTALRM,
    signal.SIGPROF,
    signal.SIGIO,
    signal.SIGQUIT,
    signal.SIGXCPU,
    signal.SIGPWR,
    signal.SIGSTKFLT,
    signal.SIGRTMIN,
    signal.SIGRTMAX,
)


def sig_name(sig: int) -> str:
    if sig == signal.SIGRTMIN:
        return "SIGRTMIN"
    if signal.SIGRTMIN < sig <= signal.SIGRTMAX:
        return f"SIGRTMIN+{sig - signal.SIGRTMIN}"
    return signal.Signals(sig).name


def collect(
    d: DaemonProcess, done: Any, timeout: float = 20.0, what: str = ""
) -> list[dict[str, Any]]:
    """The daemon's events from now until `done(events so far)` holds."""
    got: list[dict[str, Any]] = []

    def take(e: dict[str, Any]) -> bool:
        got.append(e)
        return bool(done(got))

    d.wait_for(take, timeout, what)
    return got


def received(events: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Signals the log says were received: name -> how many."""
    counts: dict[str, int] = {}
    for e in events:
        if e.get("event") == "signal received":
            counts[e["signal"]] = counts.get(e["signal"], 0) + int(e["count"])
    return counts


def mask(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_stray_signals_neither_end_the_daemon_nor_touch_sglang(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path)) as d:
        d.wait_state("ready")
        pid = d.sglang_pid()
        for sig in STRAYS:
            os.kill(d.proc.pid, sig)
        names = {sig_name(s) for s in STRAYS}
        events = collect(
            d,
            lambda got: (
                set(received(got)) >= names and any(e.get("event") == "daemon stacks" for e in got)
            ),
            what=f"a line for each of {sorted(names)}",
        )
        lines = [e for e in events if e.get("event") == "signal received"]
        assert all(e["level"] == "warning" for e in lines)
        does = {e["signal"]: e["does"] for e in lines}
        assert does.pop("SIGUSR1") == "stacks"
        assert set(does.values()) == {"nothing"}
        # SIGUSR1: every thread's Python stack, the loop's own among them, in one event.
        (dump,) = [e for e in events if e.get("event") == "daemon stacks"]
        main = [t for t in dump["threads"] if t["thread"] == "MainThread"]
        assert main and any("supervisor/daemon/signals.py" in f for f in main[0]["stack"])
        assert all(t["stack"] for t in dump["threads"])

        assert d.proc.poll() is None
        status = d.status()
        assert status["state"] == "ready"
        assert status["child"]["pid"] == pid  # SGLang never restarted
        assert status["restarts"] == {}
        assert d.get("/readyz").status_code == 200
        assert "restarting" not in d.states()
        # Handlers, not SIG_IGN: SGLang got every one of them at SIG_DFL, unblocked.
        bits = sum(1 << (s - 1) for s in STRAYS)
        for field in ("SigIgn", "SigBlk", "SigCgt"):
            assert mask(pid, field) & bits == 0, field
        assert d.stop() == 0


def test_a_storm_of_signals_is_counted_in_a_line_a_second(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path)) as d:
        d.wait_state("ready")
        pid = d.sglang_pid()
        first = len(d.seen)
        for _ in range(20):  # realtime signals queue: none merges with another
            os.kill(d.proc.pid, signal.SIGRTMIN)
        for _ in range(20):
            os.kill(d.proc.pid, signal.SIGUSR1)
            time.sleep(0.01)
        # Counted in full once the window after the first line ends (its line comes then).
        collect(
            d,
            lambda got: received(got).get("SIGRTMIN", 0) == 20 and "SIGUSR1" in received(got),
            what="20 SIGRTMIN counted",
        )
        d.states()  # takes in what has come since
        events = d.seen[first:]
        lines = [e for e in events if e.get("event") == "signal received"]
        rt = [e for e in lines if e["signal"] == "SIGRTMIN"]
        assert sum(e["count"] for e in rt) == 20
        # Queued together, read together: fewer lines than signals (one, and one for the
        # rest of its second).
        assert len(rt) < 20
        usr1 = [e for e in lines if e["signal"] == "SIGUSR1"]
        # Standard signals merge while one is pending: at most 20 arrive, all of them counted.
        assert 1 <= sum(e["count"] for e in usr1) <= 20
        assert len(usr1) <= sum(e["count"] for e in usr1)

        def dumps() -> int:
            d.states()  # takes in what has come since
            return sum(e.get("event") == "daemon stacks" for e in d.seen[first:])

        # Each SIGUSR1 line is followed by its stack dump.
        wait_until(lambda: dumps() >= len(usr1), 20, "a stack dump per SIGUSR1 line")
        assert dumps() == len(usr1)
        # Faster than the loop reads: asyncio's wakeup socket fills and the rest are dropped,
        # survived and not counted, without a traceback on stderr for each.
        burst = signal.SIGRTMIN + 1
        for _ in range(1000):
            os.kill(d.proc.pid, burst)
        collect(d, lambda got: sig_name(burst) in received(got), what="the burst's first line")
        d.states()  # takes in what has come since
        assert not [line for line in d.raw if not line.startswith("{")], d.raw[-5:]
        assert d.proc.poll() is None
        status = d.status()
        assert status["state"] == "ready"
        assert status["child"]["pid"] == pid
        assert status["restarts"] == {}
        assert d.stop() == 0


def test_a_stray_signal_during_a_hand_over_waits_for_the_new_daemon(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path)) as d:
        d.wait_state("ready")
        pid = d.sglang_pid()
        daemon_pid = d.proc.pid
        assert d.post("/reexec").status_code == 202
        d.wait_for(lambda e: e.get("event") == "hand-over: exec", timeout=30)
        # Blocked across the exec: pending until the new daemon's handlers are set.
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGRTMIN):
            os.kill(daemon_pid, sig)
        events = collect(
            d,
            lambda got: (
                any(e.get("event") == "hand-over complete" for e in got)
                and set(received(got)) >= {"SIGUSR1", "SIGUSR2", "SIGALRM", "SIGRTMIN"}
            ),
            timeout=30,
            what="the hand-over and a line for each signal",
        )
        assert d.proc.poll() is None and d.proc.pid == daemon_pid
        status = d.status()
        assert status["state"] == "ready"
        assert status["child"]["pid"] == pid
        assert status["daemon"]["last_handoff"]["outcome"] == "ok"
        assert any(e.get("event") == "daemon stacks" for e in events)
        assert d.stop() == 0
