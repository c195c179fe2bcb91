"""Every stand-in fault, a few times each, against the real daemon: the right restart reason,
never ready while decode is broken, nothing of a replaced launch left alive, the daemon's own
loop never stalls (WATCHDOG=1 to a fake systemd socket), /status and /metrics agree.

KIMI_SERVE_RELIABILITY_REPEAT=N repeats each fault N times (default 2; raise it for a soak).
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.standin.faults import FAULTS
from testkit.reliability import (
    MAX_WATCHDOG_GAP_S,
    Run,
    Segment,
    Trial,
    config,
    disagreements,
    event_time,
    false_ready,
    is_event,
    is_state,
    metric_samples,
    repeat,
    segments,
    supervised,
    trial,
)

pytestmark = pytest.mark.timeout(90)

# Short liveness timings so a hang is found in about two seconds.
LIVENESS = {"interval": "0.3s", "timeout": "0.6s", "failure_threshold": 2}
DRAIN_S = 1.0
# Stopping takes the drain, the SIGKILL and the sweep; the rest is process start-up slack.
STOP_MARGIN_S = 4.0


@dataclasses.dataclass(frozen=True)
class Case:
    drive: str  # which scenario below runs it
    reasons: frozenset[str] = frozenset()  # acceptable restart reasons; empty: no restart
    broken_decode: bool = False  # the faulty launch must never be called ready
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    cfg: dict[str, Any] = dataclasses.field(default_factory=dict)
    fault: str = ""  # the stand-in's fault, when the case's name is not it


CASES: dict[str, Case] = {
    # The scheduler's traceback is a fatal log line; whichever the daemon sees first (the
    # line or the failed probe) names the restart.
    "seed-incident": Case("recover", frozenset({"fatal_log", "readiness_failed"}), True),
    "decode-500": Case("recover", frozenset({"readiness_failed"}), True),
    "decode-zero-tokens": Case("recover", frozenset({"readiness_failed"}), True),
    "decode-hang": Case("recover", frozenset({"liveness_failed"})),
    "exit-after": Case("recover", frozenset({"exited"}), env={"STANDIN_EXIT_AFTER": "0.5"}),
    # The scheduler's traceback (a fatal pattern) and the exit arrive together; the label is
    # whichever the daemon reads first, in practice fatal_log.
    "crash-during-load": Case("recover", frozenset({"exited", "fatal_log"}), True),
    "never-ready": Case(
        "recover", frozenset({"load_timeout"}), True, cfg={"readiness": {"load_timeout": "2s"}}
    ),
    "orphans": Case("kill_main", frozenset({"exited"})),
    "ignore-sigterm": Case("stop"),
    # Every decode takes 1.2 s while SGLang's token counter advances: longer than the
    # liveness timeout (busy, not hung), shorter than the readiness timeout.
    "slow-decode": Case("busy", env={"STANDIN_SLOW_DECODE_SECONDS": "1.2"}),
    "log-flood": Case("flood", env={"STANDIN_FLOOD_LINES": "100000"}),
    # The decode hangs from the very first request: the readiness probe times out while
    # SGLang's token counter stands still (hung, not busy).
    "decode-hang from the first decode": Case(
        "recover",
        frozenset({"readiness_failed"}),
        True,
        env={"STANDIN_HANG_AFTER_DECODES": "0"},
        cfg={"readiness": {"probe": {"timeout": "1s"}}},
        fault="decode-hang",
    ),
}


# Serving-quality faults: the launch serves (nothing to recover from) and the verdicts are
# degraded reasons, not restarts (a canary mismatch under `gate` needs a golden learned on an
# earlier launch); tests/integration/test_quality.py runs each against the real daemon.
QUALITY_FAULTS = frozenset({"wrong-answer", "spec-collapse", "no-cuda-graph"})


def test_every_standin_fault_is_in_the_matrix() -> None:
    matrix = {case.fault or name for name, case in CASES.items()}
    assert matrix | QUALITY_FAULTS == set(FAULTS)
    assert not matrix & QUALITY_FAULTS


def _gone_after_restart(run: Run, t: Trial, launch: int) -> None:
    """Every process recorded for `launch` is dead now that a later launch is ready."""
    label = (run.pid, launch)
    assert run.procs.launch(label), f"no process of launch {launch} was ever recorded"
    left = run.procs.alive(lambda lab: lab == label)
    t.orphans += len(left)
    assert not left, f"processes of launch {launch} survive its replacement: {left}"


def _agree(run: Run) -> None:
    problems = disagreements(run.d.admin)
    assert not problems, problems


def recover(run: Run, case: Case, t: Trial) -> None:
    """The fault on launch 1 causes one restart with the right reason; launch 2 is ready."""
    restart = run.d.wait_for(is_state("restarting"), timeout=30, what="the restart")
    t.notes["reason"] = restart["reason"]
    assert restart["reason"] in case.reasons, restart
    _agree(run)
    run.d.wait_for(is_state("ready"), timeout=30, what="ready after the restart")
    st = run.status()
    assert st["child"]["launch"] == 2
    assert st["last_restart"]["reason"] == restart["reason"]
    assert st["restarts"] == {restart["reason"]: 1}
    _gone_after_restart(run, t, 1)
    t.recovered = True


def kill_main(run: Run, case: Case, t: Trial) -> None:
    """orphans: the children left SGLang's process group; SIGKILL the main process."""
    run.d.wait_for(is_state("ready"), timeout=30, what="ready")
    child, _ = run.kill_sglang(signal.SIGKILL)
    escaped = [p for p in run.procs.launch((run.pid, 1)) if p.pid != child["pid"]]
    assert escaped, "the orphans fault started no children"
    restart = run.d.wait_for(is_state("restarting"), timeout=30, what="the restart")
    t.notes["reason"] = restart["reason"]
    assert restart["reason"] in case.reasons, restart
    run.d.wait_for(is_state("ready"), timeout=30, what="ready after the restart")
    run.status()
    _gone_after_restart(run, t, 1)
    t.recovered = True


def stop(run: Run, case: Case, t: Trial) -> None:
    """ignore-sigterm: SIGTERM to the daemon stops everything within drain_timeout + margin."""
    run.d.wait_for(is_state("ready"), timeout=30, what="ready")
    run.status()
    start = time.monotonic()
    run.d.signal(signal.SIGTERM)
    code = run.d.proc.wait(DRAIN_S + 30)
    took = time.monotonic() - start
    t.notes["stop_s"] = round(took, 2)
    assert code == 0
    assert took <= DRAIN_S + STOP_MARGIN_S, f"stop took {took:.1f} s"
    left = run.procs.alive(lambda _lab: True)
    t.orphans += len(left)
    assert not left, left
    assert "restarting" not in run.d.states()
    t.recovered = True


def busy(run: Run, case: Case, t: Trial) -> None:
    """slow-decode: liveness probes time out but generation advances: never a restart."""
    run.d.wait_for(is_state("ready"), timeout=30, what="ready")
    threshold = LIVENESS["failure_threshold"]
    assert isinstance(threshold, int)
    for _ in range(threshold + 1):
        ev = run.d.wait_for(
            lambda e: e.get("event") == "probe failed" and e.get("kind") == "liveness",
            timeout=15,
            what="a slow liveness probe",
        )
        assert ev["busy"] is True, ev
    assert "restarting" not in run.d.states()
    assert run.status()["state"] == "ready"
    _agree(run)
    t.recovered = True


def flood(run: Run, case: Case, t: Trial) -> None:
    """log-flood: 100 000 lines before loading; ready anyway, every line counted."""
    run.d.wait_for(is_state("ready"), timeout=40, what="ready")
    assert run.d.get("/livez").status_code == 200
    samples = metric_samples(run.d.get("/metrics").text)
    lines = sum(v for _, v in samples.get("kimi_serve_log_lines_total", []))
    assert lines >= 100_000
    assert "restarting" not in run.d.states()
    t.recovered = True


DRIVERS: dict[str, Callable[[Run, Case, Trial], None]] = {
    f.__name__: f for f in (recover, kill_main, stop, busy, flood)
}


@pytest.mark.parametrize("rep", range(repeat()))
@pytest.mark.parametrize("name", sorted(CASES))
def test_fault(tmp_path: Path, name: str, rep: int) -> None:
    case = CASES[name]
    fault = case.fault or name
    env = {"STANDIN_FAULT": fault, "STANDIN_FAULT_LAUNCH": "1", **case.env}
    cfg = config(
        tmp_path,
        sglang={"env": env},
        liveness=LIVENESS,
        stop={"drain_timeout": f"{DRAIN_S}s"},
        **case.cfg,
    )
    with trial("fault matrix", name) as t, supervised(tmp_path, cfg, t) as run:
        try:
            DRIVERS[case.drive](run, case, t)
        finally:
            t.false_ready = _false_ready(segments(run.events()), case)
        until = time.monotonic() if run.d.proc.poll() is None else None
        gap = run.notify.max_watchdog_gap(until=until)
        t.notes["watchdog_gap_s"] = round(gap, 2)
        assert gap < MAX_WATCHDOG_GAP_S, f"the daemon's loop went {gap:.2f} s without a ping"
        if run.d.proc.poll() is None:
            _agree(run)
            assert run.d.stop() == 0
        segs = segments(run.events())
        # The stand-in says what it injected: the fault was really on launch 1, alone.
        assert segs[0].faults == {fault}, segs[0].faults
        assert all(not s.faults for s in segs[1:])
        t.false_ready = _false_ready(segs, case)
        assert not t.false_ready, "ready while decode was broken"
        # systemd heard READY=1 exactly once per warming -> ready, never otherwise.
        readies = sum(1 for e in run.events() if is_state("ready")(e) and e["old"] == "warming")
        assert _eventually(lambda: run.notify.count("READY=1") >= readies)
        assert run.notify.count("READY=1") == readies
        assert any(is_event("state")(e) and e["new"] == "stopped" for e in run.events())


def _false_ready(segs: list[Segment], case: Case) -> int:
    """Launches called ready although their decode never worked."""
    bad = {s.launch for s in false_ready(segs)}
    if case.broken_decode and segs and segs[0].was_ready:
        bad.add(segs[0].launch)
    return len(bad)


def _eventually(cond: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_second_sigterm_cuts_a_long_drain_short(tmp_path: Path) -> None:
    """ignore-sigterm with a 30 s drain: the operator's second SIGTERM kills at once."""
    env = {"STANDIN_FAULT": "ignore-sigterm", "STANDIN_FAULT_LAUNCH": "1"}
    cfg = config(tmp_path, sglang={"env": env}, stop={"drain_timeout": "30s"})
    with (
        trial("fault matrix", "ignore-sigterm, then a second SIGTERM") as t,
        supervised(tmp_path, cfg, t) as run,
    ):
        run.d.wait_for(is_state("ready"), timeout=30, what="ready")
        run.status()
        start = time.monotonic()
        run.d.signal(signal.SIGTERM)
        run.d.wait_for(is_state("stopping"), timeout=10, what="stopping")
        run.d.signal(signal.SIGTERM)
        assert run.d.proc.wait(30) == 0
        took = time.monotonic() - start
        t.notes["stop_s"] = round(took, 2)
        assert took < STOP_MARGIN_S, f"the second SIGTERM still waited: {took:.1f} s"
        left = run.procs.alive(lambda _lab: True)
        t.orphans += len(left)
        assert not left
        t.recovered = True


def test_frozen_sglang_is_found_within_the_liveness_budget(tmp_path: Path) -> None:
    """SIGSTOP of SGLang's main process (a debugger, a cgroup freezer, a wedged host)."""
    cfg = config(tmp_path, liveness=LIVENESS, stop={"drain_timeout": f"{DRAIN_S}s"})
    # threshold x (interval + timeout + the abort of the timed-out probe, bounded by the timeout)
    budget = LIVENESS["failure_threshold"] * (0.3 + 0.6 + 0.6)
    with (
        trial(
            "fault matrix",
            "SIGSTOP of SGLang (frozen)",
        ) as t,
        supervised(tmp_path, cfg, t) as run,
    ):
        run.d.wait_for(is_state("ready"), timeout=30, what="ready")
        _, at = run.kill_sglang(signal.SIGSTOP)
        restart = run.d.wait_for(
            is_state("restarting"), timeout=budget + 1.5, what="the restart, within budget"
        )
        t.notes["reason"] = restart["reason"]
        t.notes["detect_s"] = round(event_time(restart) - at, 2)
        assert restart["reason"] == "liveness_failed"
        run.d.wait_for(is_state("ready"), timeout=30, what="ready after the restart")
        _gone_after_restart(run, t, 1)
        t.recovered = True
