"""Random sequences of things going wrong, against the real daemon and the stand-in.

Hypothesis drives a state machine whose steps are: SIGKILL of SGLang; a fault scheduled for
the next launch; config reloads (changed, unchanged, invalid); a manual restart; SIGTERM or
SIGKILL of the daemon itself (a new one then takes over the same state directory). Each step
happens either at once (whatever the daemon is doing: loading, draining, backing off) or once
it is ready. After every step the invariants hold: the daemon runs, its loop never stalled,
/status and /metrics agree, nothing of an earlier launch (or an earlier daemon) is alive, no
launch with broken decode was called ready, no traceback reached its output. At the end it gets
back to ready by itself, and a SIGTERM leaves nothing behind.

The stand-in reads its fault once, at start, from STANDIN_FAULT (+ STANDIN_FAULT_LAUNCH and a
shared launch counter), so a running SGLang cannot be switched to "hang" in place. A fault is
therefore scheduled by rewriting the config with the fault pinned to the next launch number and
sending SIGHUP: the reload restarts SGLang into that launch. Which launch really got which
fault is read back from the stand-in's first log line, so the checks never rely on the guess.

Bounded for CI (5 examples x 8 steps, derandomized). A soak:
    KIMI_SERVE_RELIABILITY_SOAK=10 .venv/bin/pytest tests/reliability/test_random_sequences.py
(10x the examples and steps, fresh random draws, shrinking on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from testkit import free_port, owned_processes
from testkit.reliability import (
    MAX_WATCHDOG_GAP_S,
    RESULTS,
    Run,
    Trial,
    config,
    disagreements,
    false_ready,
    is_event,
    is_state,
    segments,
    soak_factor,
    stale_processes,
    supervised,
    write_config,
)

SOAK = soak_factor()
EXAMPLES = 5 * SOAK
STEPS = 8 * SOAK
DRAIN_S = 1.0
STOP_MARGIN_S = 4.0
pytestmark = pytest.mark.timeout(150 * SOAK * SOAK)

# Every stand-in fault but log-flood: past the daemon's forwarding limit its lines are counted
# but not all forwarded, which would hide the stand-in's first line (what launch got what).
# Hypothesis's first, simplest example takes the first entry: a decode that fails the readiness
# probe, so even the shortest CI run tests "never ready while decode is broken".
SCHEDULE = (
    "decode-500",
    "decode-zero-tokens",
    "seed-incident",
    "decode-hang",
    "exit-after",
    "crash-during-load",
    "never-ready",
    "orphans",
    "ignore-sigterm",
    "slow-decode",
    "none",
)
MOMENTS = st.sampled_from(["now", "ready"])
BAD_CONFIG = "sglang: [not, a, mapping]\n"

F = TypeVar("F", bound=Callable[..., Any])


def step(fn: F) -> F:
    """Counts the step for the report; a failing step marks the example failed."""

    @functools.wraps(fn)
    def wrapper(self: Sequences, *args: Any, **kwargs: Any) -> Any:
        self.trial.notes.setdefault("steps", []).append(
            fn.__name__ + "".join(f" {v}" for v in kwargs.values())
        )
        try:
            return fn(self, *args, **kwargs)
        except BaseException:
            self.broken = True
            raise

    return wrapper  # type: ignore[return-value]


def check(fn: F) -> F:
    """An invariant; a failing one marks the example failed."""

    @functools.wraps(fn)
    def wrapper(self: Sequences) -> None:
        try:
            fn(self)
        except BaseException:
            self.broken = True
            raise

    return wrapper  # type: ignore[return-value]


class Sequences(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="kimi-serve-seq-"))
        self.trial = Trial("random fault sequences", f"{EXAMPLES} examples x {STEPS} steps")
        self.started = time.monotonic()
        self.broken = False
        self.stack = contextlib.ExitStack()
        self.env = {
            **config(self.tmp)["sglang"]["env"],
            "STANDIN_EXIT_AFTER": "1",
            "STANDIN_SLOW_DECODE_SECONDS": "1.5",
        }
        self.cfg = config(
            self.tmp,
            sglang={"env": self.env},
            readiness={"load_timeout": "3s"},
            liveness={"interval": "0.3s", "timeout": "0.6s", "failure_threshold": 2},
            restart={"crash_loop": {"max_restarts": 1000, "window": "1h"}},
            stop={"drain_timeout": f"{DRAIN_S}s"},
        )
        self.runs: list[Run] = []
        self.run = self._start()
        self.run.d.wait_for(is_state("ready"), timeout=30, what="the first ready")

    # ---------------------------------------------------------------- helpers

    def _start(self) -> Run:
        # Each daemon gets its own admin port: the one a SIGKILLed daemon held may linger.
        self.cfg["admin"]["listen"] = f"127.0.0.1:{free_port()}"
        run = self.stack.enter_context(supervised(self.tmp, self.cfg, self.trial))
        self.runs.append(run)
        run.d.wait_for(is_event("admin endpoint"), timeout=30, what="the admin endpoint")
        assert run.notify.wait_pings(after=0.0, count=1, timeout=10), "no WATCHDOG=1 at all"
        return run

    def _at(self, moment: str) -> None:
        if moment == "ready":
            self._wait_status(lambda s: s["state"] == "ready", 30, "ready")

    def _wait_status(
        self, cond: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st_ = self.run.status()
            if cond(st_):
                return st_
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {st_['state']}"
            time.sleep(0.05)

    def _write(self, cfg: dict[str, Any]) -> None:
        write_config(self.run.d.config_path, cfg)

    def _reload(self) -> dict[str, Any]:
        self.run.d.signal(signal.SIGHUP)
        return self.run.d.wait_for(is_event("reload"), timeout=15, what="the reload's answer")

    def _launches(self) -> int:
        try:
            return int((self.tmp / "launches").read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _stop_daemon(self) -> None:
        """SIGTERM: exit 0 within the drain timeout and a margin, nothing left behind."""
        start = time.monotonic()
        self.run.d.signal(signal.SIGTERM)
        code = self.run.d.proc.wait(DRAIN_S + 30)
        took = time.monotonic() - start
        assert code == 0, self.run.d.raw[-10:]
        assert took <= DRAIN_S + STOP_MARGIN_S, f"stop took {took:.1f} s"
        left = owned_processes(self.run.d.owner)
        self.trial.orphans += len(left)
        assert not left, [p.pid for p in left]

    # ---------------------------------------------------------------- steps

    @rule(moment=MOMENTS)
    @step
    def kill_sglang(self, moment: str) -> None:
        self._at(moment)
        st_ = self.run.status()
        child = st_["child"]
        if child is None or st_["state"] not in (
            "launching",
            "loading",
            "warming",
            "ready",
            "degraded",
        ):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(child["pid"], signal.SIGKILL)
        # The death of a running child always leads to a restart (for this or another reason).
        self.run.d.wait_for(is_state("restarting"), timeout=15, what="restart after SIGKILL")

    @initialize(fault=st.sampled_from(SCHEDULE))
    @step
    def first_fault(self, fault: str) -> None:
        """Every example starts with a fault on the next launch, judged to the end (ready or a
        restart) before anything else happens; then anything may follow."""
        if self._schedule(fault)["event"] == "reload: configuration unchanged":
            return  # "none" on a config without a fault
        self.run.d.wait_for(is_state("launching"), timeout=30, what="the faulty launch")
        self.run.d.wait_for(
            lambda e: is_state("ready")(e) or is_state("restarting")(e),
            timeout=30,
            what="the verdict on the faulty launch",
        )

    @rule(fault=st.sampled_from(SCHEDULE), moment=MOMENTS)
    @step
    def schedule_fault(self, fault: str, moment: str) -> None:
        self._at(moment)
        self._schedule(fault)

    def _schedule(self, fault: str) -> dict[str, Any]:
        env = dict(self.env)
        if fault != "none":
            env["STANDIN_FAULT"] = fault
            env["STANDIN_FAULT_LAUNCH"] = str(self._launches() + 1)
        self.cfg["sglang"]["env"] = env
        self._write(self.cfg)
        ev = self._reload()
        assert not ev["event"].startswith("reload refused"), ev
        return ev

    @rule(moment=MOMENTS)
    @step
    def reload_changed(self, moment: str) -> None:
        self._at(moment)
        liveness = self.cfg["liveness"]
        liveness["interval"] = "0.35s" if liveness["interval"] == "0.3s" else "0.3s"
        self._write(self.cfg)
        ev = self._reload()
        assert ev["event"].startswith("reload: configuration changed"), ev

    @rule(moment=MOMENTS)
    @step
    def reload_unchanged(self, moment: str) -> None:
        self._at(moment)
        ev = self._reload()
        assert ev["event"] == "reload: configuration unchanged", ev

    @rule(moment=MOMENTS)
    @step
    def reload_invalid(self, moment: str) -> None:
        self._at(moment)
        before = self.run.status()
        self.run.d.config_path.write_text(BAD_CONFIG)
        ev = self._reload()
        assert ev["event"].startswith("reload refused"), ev
        self._write(self.cfg)
        after = self.run.status()
        # Refused means refused: no restart because of it.
        assert after["restarts"].get("reload", 0) == before["restarts"].get("reload", 0)

    @rule(moment=MOMENTS)
    @step
    def manual_restart(self, moment: str) -> None:
        self._at(moment)
        r = self.run.d.post("/restart")
        assert r.status_code in (202, 409), r.text

    @rule(moment=MOMENTS)
    @step
    def sigterm_daemon(self, moment: str) -> None:
        self._at(moment)
        self._stop_daemon()
        self.run = self._start()

    @rule(moment=MOMENTS)
    @step
    def sigkill_daemon(self, moment: str) -> None:
        self._at(moment)
        self.run.d.proc.kill()
        self.run.d.proc.wait(5)
        self.run.check_leftovers = False  # the next daemon owns the cleanup
        self.run = self._start()
        # The successor removes what the dead daemon left before it launches anything.
        self.run.d.wait_for(is_state("launching"), timeout=30, what="the successor's launch")

    # ---------------------------------------------------------------- invariants

    @invariant()
    @check
    def daemon_runs(self) -> None:
        assert self.run.d.proc.poll() is None, self.run.d.raw[-10:]

    @invariant()
    @check
    def loop_never_stalled(self) -> None:
        gap = self.run.notify.max_watchdog_gap(until=time.monotonic())
        assert gap < MAX_WATCHDOG_GAP_S, f"no WATCHDOG=1 for {gap:.2f} s"

    @invariant()
    @check
    def status_and_metrics_agree(self) -> None:
        problems = disagreements(self.run.d.admin)
        assert not problems, problems

    @invariant()
    @check
    def nothing_of_earlier_launches_alive(self) -> None:
        st_ = self.run.status()
        launch = st_["child"]["launch"] if st_["child"] else None
        # No race here: launch L began only after every earlier process was gone, and the
        # processes are looked at after /status named L.
        left = stale_processes(self.run, st_["state"], launch)
        self.trial.orphans += len(left)
        assert not left, (st_["state"], launch, left)

    @invariant()
    @check
    def never_ready_with_broken_decode(self) -> None:
        bad = [s for run in self.runs for s in false_ready(segments(run.events()))]
        self.trial.false_ready = len(bad)
        assert not bad, [(s.launch, s.faults, s.new_states) for s in bad]

    # ---------------------------------------------------------------- the end

    def teardown(self) -> None:
        try:
            if not self.broken and self.run.d.proc.poll() is None:
                # Faults are per launch: whatever happened, it gets back to serving by itself.
                self._wait_status(lambda s: s["state"] == "ready", 40, "ready at the end")
                self.trial.recovered = True
                self._stop_daemon()
            self.stack.close()  # stops what still runs; checks leftovers and tracebacks
            faults = [sorted(s.faults) for r in self.runs for s in segments(r.events()) if s.faults]
            self.trial.notes["faulty_launches"] = faults
            self.trial.passed = not self.broken
        except BaseException:
            self.trial.passed = False
            raise
        finally:
            self.trial.seconds = round(time.monotonic() - self.started, 2)
            RESULTS.append(dataclasses.asdict(self.trial))
            shutil.rmtree(self.tmp, ignore_errors=True)


TestSequences = Sequences.TestCase
TestSequences.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    database=None,
    derandomize=SOAK == 1,
    # A replay costs seconds of real processes; shrinking is for the soak, where a minimal
    # failing sequence is worth the wait.
    phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if SOAK > 1 else []),
    suppress_health_check=list(HealthCheck),
)
