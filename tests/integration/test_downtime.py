"""A real restart of the stand-in, measured: downtime, the caches and the prewarm in /status."""

from __future__ import annotations

import os
import re
import signal
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from supervisor.warm import prewarm
from testkit import base_config, running

pytestmark = pytest.mark.timeout(90)

WEIGHTS = 24 << 20


def _at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def _histogram(metrics: str) -> tuple[float, float]:
    count = re.search(r"^kimi_serve_restart_downtime_seconds_count (\S+)$", metrics, re.M)
    total = re.search(r"^kimi_serve_restart_downtime_seconds_sum (\S+)$", metrics, re.M)
    assert count and total, "the downtime histogram is missing"
    return float(count.group(1)), float(total.group(1))


def test_a_crash_restart_is_measured_and_a_requested_one_is_not(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, warm={"prewarm": "auto"})
    weights = Path(cfg["sglang"]["model_path"]) / "model.safetensors"
    weights.write_bytes(os.urandom(WEIGHTS))
    prewarm.evict(weights)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        assert _histogram(d.get("/metrics").text) == (0.0, 0.0)  # present from the first scrape
        load = d.status()["last_load"]
        assert set(load["caches"]) >= {"deepgemm", "inductor", "triton", "flashinfer", "cuda"}
        assert load["caches"]["triton"]["path"] == f"{tmp_path}/state/cache/triton"
        first = load["prewarm"]
        assert first["total"] == WEIGHTS and 0 <= first["bytes"] <= first["planned"]

        weights.read_bytes()  # resident now, as a real SGLang's load leaves its weights

        os.kill(d.status()["child"]["pid"], signal.SIGKILL)
        left = d.wait_state("restarting")
        back = d.wait_state("ready")
        status = d.status()
        down = status["last_restart"]["downtime_s"]
        # From leaving ready to ready again, as the daemon's own log has those two moments.
        assert down == pytest.approx(_at(back) - _at(left), abs=0.05)
        assert down >= float(cfg["restart"]["backoff_initial"].rstrip("s"))
        count, total = _histogram(d.get("/metrics").text)
        assert count == 1.0 and total == pytest.approx(down, abs=0.01)
        # The relaunch found the weights resident: the prewarm read nothing of them again.
        again = status["last_load"]["prewarm"]
        assert again["resident_before"] == WEIGHTS and again["bytes"] == 0

        assert d.post("/restart").status_code == 202
        d.wait_state("restarting")
        d.wait_state("ready")
        assert d.status()["last_restart"]["downtime_s"] is None  # somebody asked for it
        assert _histogram(d.get("/metrics").text)[0] == 1.0
