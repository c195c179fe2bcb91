"""A model directory that is not there yet (a mount that comes late): the real daemon waits in
`waiting` with reason `model_missing`, says so in /status, the metrics and STATUS=, checks again
without counting a restart, and launches once the directory appears."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from testkit import base_config
from testkit.daemon import DaemonProcess, reaped
from testkit.notify import NotifyListener

pytestmark = pytest.mark.timeout(90)


def test_a_missing_model_waits_then_launches_when_it_appears(tmp_path: Path) -> None:
    model = tmp_path / "mnt" / "kimi"
    cfg = base_config(tmp_path, sglang={"model_path": str(model)})
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    listener = NotifyListener()
    env = {**os.environ, "NOTIFY_SOCKET": listener.address}
    try:
        with reaped(DaemonProcess.start(path, cfg, env)) as d:
            entered = d.wait_state("waiting")
            assert entered["reason"] == "model_missing"
            assert str(model) in entered["detail"] and entered["level"] == "warning"
            # Checked again (the same state, the same reason), never a restart.
            again = d.wait_for(
                lambda e: (
                    e.get("event") == "state"
                    and (e.get("old"), e.get("new")) == ("waiting", "waiting")
                ),
                what="a second check while waiting",
            )
            assert again["reason"] == "model_missing"

            doc = d.status()
            assert doc["state"] == "waiting" and str(model) in doc["detail"]
            assert doc["events"][-1]["reason"] == "model_missing"
            assert doc["restarts"] == {} or not any(doc["restarts"].values())
            assert "model_missing" in doc["status_line"]
            metrics = d.get("/metrics").text
            assert 'kimi_serve_state{state="waiting"} 1.0' in metrics
            assert "kimi_serve_child_starts_total 0.0" in metrics
            statuses = [m for _, m in listener.messages if m.startswith("STATUS=waiting")]
            assert statuses and "model_missing" in statuses[-1], listener.messages

            model.mkdir(parents=True)
            (model / "config.json").write_text("{}\n")
            d.wait_state("ready", timeout=30)
            left = [e for e in d.seen if e.get("event") == "state" and e["old"] == "waiting"]
            assert left[-1]["new"] == "launching"
            metrics = d.get("/metrics").text
            assert 'kimi_serve_state{state="waiting"} 0.0' in metrics
            assert 'kimi_serve_restarts_total{reason="exited"}' not in metrics or (
                'kimi_serve_restarts_total{reason="exited"} 0.0' in metrics
            )
    finally:
        listener.close()
