"""The benchmark harness, run at tiny sizes so it cannot rot: `python -m bench --quick` against
kimi-serve and the /health poller model. It checks that every figure came out and that
nothing the bench started is left running; it does not judge the numbers (docs/benchmarks.md
does, from a full run)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench.common import MARKER

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _marked(run_id: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(MARKER) == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
    return found


def test_quick_bench_runs_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--only",
            "kimi-serve,health-poller",
            "--json",
            str(out),
            "--markdown",
            str(md),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["not_measured"] == {}, results["not_measured"]
    assert results["left_behind"] == []
    assert _marked(results["run_id"]) == []

    kimi = results["kimi-serve"]
    cycles = kimi["cycles"]
    assert len(cycles["death"]) == results["settings"]["cycles"]
    assert cycles["left_behind"] == []
    for sample in cycles["readiness"]:
        # Ready is reported only after the server could serve a decode.
        assert sample["ready"] >= sample["bind"]
    assert kimi["false_ready"]["trials"] >= 1
    assert kimi["false_ready"]["false_ready"] == 0
    assert [t["reason"] for t in kimi["hang"]["trials"]] == ["liveness_failed"]
    assert results["log_pump"]["kimi-serve-counted"] == results["log_pump"]["kimi-serve-written"]
    assert results["footprint"]["kimi-serve"]["rss_mib"]

    poller = results["health-poller"]
    assert all(not t["decode_ok"] and t["still_ready"] for t in poller["false_ready"])
    assert not poller["hang"][0]["detected"]

    for title in (
        "Goals",
        "1. Readiness lag",
        "2. False ready",
        "3. Death detection",
        "4. Hang detection",
        "5. Recovery",
        "6. Log pump",
        "7. Footprint",
    ):
        assert title in done.stdout
        assert title in md.read_text()
    # --quick stays quick: 30 s on an idle machine, scaled by how busy the cores were (other
    # work on a shared host stretches every step of it alike).
    load = max(results["machine"]["loadavg_start"][0], results["machine"]["loadavg_end"][0])
    limit = 30 * max(1.0, load / (os.cpu_count() or 1))
    assert results["seconds"] < limit, f"--quick took {results['seconds']} s at load {load:.1f}"
