"""Trials and the last known good against the stand-in: a launch that served trial_period is the
LKG (stored), a changed config is a trial, a trial whose canary regresses is rolled back to the
LKG (never ready itself) or held, and `kimi-serve upgrade` reports and decides."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from testkit import base_config, running
from testkit.cli import kimi_serve
from testkit.daemon import DaemonProcess

pytestmark = pytest.mark.timeout(120)


def _config(tmp: Path, **quality: Any) -> dict[str, Any]:
    return base_config(tmp, quality={"trial_period": "1s", **quality})


def _lkg_recorded(d: DaemonProcess) -> dict[str, Any]:
    d.wait_state("ready", 30)
    d.wait_for(lambda e: e.get("event") == "last known good", 30, "the last known good")
    return d.status()["upgrade"]


def _reload_with(d: DaemonProcess, cfg: dict[str, Any], **env: str) -> None:
    cfg["sglang"]["env"].update(env)
    d.config_path.write_text(yaml.safe_dump(cfg))
    d.signal(signal.SIGHUP)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def _metric(d: DaemonProcess, line: str) -> bool:
    return line in d.get("/metrics").text


def test_a_regressed_trial_is_rolled_back_and_never_ready(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    with running(tmp_path, cfg) as d:
        first = _lkg_recorded(d)
        assert first["state"] == "accepted" and first["lkg"]["launch"] == 1
        stored = json.loads((tmp_path / "state" / "upgrade" / "lkg.json").read_text())
        assert set(stored["profiles"]) == {"primary"}
        assert _metric(d, "kimi_serve_trial 0.0")

        _reload_with(d, cfg, STANDIN_FAULT="wrong-answer")
        regressed = d.wait_reason("trial_regressed", 30, new="restarting")
        assert "canary" in regressed["detail"]
        d.wait_state("ready", 30)
        states = d.states()
        trial = states[states.index("launching", states.index("ready") + 1) :]
        assert trial.index("restarting") < trial.index("ready"), "the trial was never ready"

        up = d.status()["upgrade"]
        assert up["state"] == "rolled_back" and up["serving_lkg"] is True
        env = _environ(d.sglang_pid())
        assert "STANDIN_FAULT" not in env, "the last known good's command, not the config's"
        assert _metric(d, 'kimi_serve_rollbacks_total{regression="canary"} 1.0')
        assert _metric(d, "kimi_serve_lkg_serving 1.0")
        line = d.status()["status_line"]
        assert "ROLLED BACK" in line
        assert d.status()["last_restart"]["incident"], "an incident, as for any unrequested restart"
        human = kimi_serve("status", "--config", str(d.config_path))
        assert "Upgrade: ROLLED BACK" in human.stdout, human.stdout

        # `restart` stays on the last known good (until a reload or `upgrade accept`).
        assert d.post("/restart").status_code == 202
        d.wait_reason("manual", 20, new="restarting")
        d.wait_state("ready", 30)
        assert "STANDIN_FAULT" not in _environ(d.sglang_pid())

        shown = kimi_serve("upgrade", "status", "--json", "--config", str(d.config_path))
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["state"] == "rolled_back"
        text = kimi_serve("upgrade", "status", "--config", str(d.config_path))
        assert "ROLLED BACK" in text.stdout
        # Without a terminal and without --yes nothing is changed.
        unconfirmed = kimi_serve("upgrade", "rollback", "--config", str(d.config_path))
        assert unconfirmed.returncode == 1 and "--yes" in unconfirmed.stderr

        # A hand-over is neither a trial nor a restart: the new program adopts the last known
        # good it was serving (not the config's command) and stays rolled back.
        pid = d.sglang_pid()
        assert d.post("/reexec").status_code == 202
        done = d.wait_for(lambda e: e.get("event") == "hand-over complete", 30, "hand-over")
        assert done["state"] == "ready"
        assert d.sglang_pid() == pid
        up = d.status()["upgrade"]
        assert up["state"] == "rolled_back" and up["serving_lkg"] is True
        assert up["lkg"]["rollback_possible"] is True
        assert _metric(d, "kimi_serve_lkg_serving 1.0"), "the alert stands across the exec"
        assert d.post("/restart").status_code == 202
        d.wait_reason("manual", 20, new="restarting")
        d.wait_state("ready", 30)
        assert "STANDIN_FAULT" not in _environ(d.sglang_pid()), "still the trusted command"


def test_hold_keeps_a_regressed_trial_failed(tmp_path: Path) -> None:
    cfg = _config(tmp_path, on_trial_regression="hold")
    with running(tmp_path, cfg) as d:
        _lkg_recorded(d)
        _reload_with(d, cfg, STANDIN_FAULT="wrong-answer")
        d.wait_reason("trial_regressed", 30, new="restarting")
        d.wait_state("failed", 30)
        up = d.status()["upgrade"]
        assert up["state"] == "held" and "canary" in up["why"]
        assert d.get("/readyz").status_code == 503
        assert "HELD" in d.status()["status_line"]


def test_upgrade_requests_are_refused_without_a_last_known_good(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)  # trial_period 10m: no LKG within this test
    with running(tmp_path, cfg) as d:
        d.wait_state("ready", 30)
        r = d.post("/upgrade/rollback")
        assert r.status_code == 409 and "no last known good" in r.json()["error"]
        assert d.post("/upgrade/rollback", token=False).status_code == 401
        refused = kimi_serve(
            "upgrade", "rollback", "--yes", "--json", "--config", str(d.config_path)
        )
        assert refused.returncode == 1
        assert "no last known good" in json.loads(refused.stdout)["error"]
        assert d.status()["upgrade"]["state"] == "none"
        assert httpx.get(d.admin + "/readyz", timeout=5).status_code == 200
