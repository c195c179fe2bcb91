"""Incidents against the real SGLang 0.5.23 server on this CPU, one daemon run for all of it:
the load timeline from the real server's log markers, then a hang (its scheduler SIGSTOPped)
that the liveness probe catches, with py-spy stacks of every process taken before the kill."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from testkit import realsglang as real
from testkit.observability import series_from_exposition
from testkit.realsglang import daemon_config, real_daemon, report

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_real_load_timeline_and_stacks_of_a_hung_server(
    sgl: real.SGLangEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("real-stacks")
    cfg = daemon_config(tmp, sgl, incidents={"dump_timeout": "30s"})
    with real_daemon(tmp, cfg) as r:
        r.wait_ready()
        status = r.d.status()
        metrics = r.d.get("/metrics").text
        load = status["last_load"]
        main = int(status["child"]["pid"])
        scheduler = r.pid_of("sglang::scheduler")
        detokenizer = r.pid_of("sglang::detokenizer")
        os.kill(scheduler, signal.SIGSTOP)  # frozen, as a scheduler stuck in a CUDA call is
        ev = r.d.wait_state("restarting", 60)
        taken = r.d.wait_for(
            lambda e: e.get("event") == "stacks taken before the kill", 60, "the dump"
        )
        r.d.wait_for(lambda e: e.get("event") == "sglang restart", 60, "the restart")
        r.d.wait_state("cleaning", 60)
        last = r.d.status()["last_restart"]

    # The load, as 0.5.23 prints it on a CPU with --disable-cuda-graph (docs/sglang.md, "Load
    # markers"): no CUDA graph phase, and it is absent, not 0. Warmup is there although our
    # probe passes before SGLang's own warm-up prints its ready line: it ends at the earlier
    # of that line and the passing probe's start.
    assert load["complete"] is True, load
    assert {"init", "weights", "kv_cache", "warmup", "probe"} <= set(load["phases"]), load
    assert load["missing"] == ["cuda_graph"], load
    assert "cuda_graph" not in load["phases"]
    assert load["sglang_reported"], load  # SGLang's own "Engine startup timings" line
    phases = {n for n in series_from_exposition(metrics) if n == "kimi_serve_load_phase_seconds"}
    assert phases
    for phase, seconds in load["phases"].items():
        assert f'kimi_serve_load_phase_seconds{{phase="{phase}"}} {seconds}' in metrics
    assert 'phase="cuda_graph"' not in metrics
    for phase, seconds in load["phases"].items():
        report(f"real load phase {phase}", seconds)

    # The hang: a liveness restart, with every process's stack taken while it was alive.
    assert ev["reason"] == "liveness_failed"
    inc = Path(last["incident"])
    doc = json.loads((inc / "incident.json").read_text())
    assert doc["reason"] == "liveness_failed" and doc["stacks"]["taken"] is True
    by_pid = {p["pid"]: p for p in doc["stacks"]["processes"]}
    for pid in (main, scheduler, detokenizer):
        assert pid in by_pid and by_pid[pid]["ok"], doc["stacks"]
    text = (inc / "stacks.txt").read_text()
    # The scheduler's event loop, where a hung scheduler sits (scheduler.py's event_loop_*).
    assert "event_loop" in text, text[:3000]
    assert doc["server_info"]["version"].startswith("0.5.23")
    report("real stack dump before the kill", float(taken["seconds"]))
