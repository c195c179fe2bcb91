"""The real daemon (`kimi-serve run`) writing incidents about the real stand-in: a decode hang is
dumped with py-spy before its liveness kill and on-call finds it with `kimi-serve incidents` and
`kimi-serve status`; a process that is already dead costs no dump; a py-spy that hangs costs at
most incidents.dump_timeout."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import base_config, running
from testkit.incidents import hang_config, restart_seconds
from testkit.shadow import shadow_python, start_with

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

KIMI_SERVE = Path(sys.executable).with_name("kimi-serve")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KIMI_SERVE), *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_a_hang_leaves_its_stacks_and_on_call_finds_them(tmp_path: Path) -> None:
    cfg = hang_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        launch1 = set(d.status()["child"]["processes"])
        load = d.status()["last_load"]
        assert load["complete"] is True
        assert load["missing"] == [], load  # the stand-in prints every marker, warmup included
        ev = d.wait_state("restarting", 30)
        assert ev["reason"] == "liveness_failed"
        taken = d.wait_for(lambda e: e.get("event") == "stacks taken before the kill", 30, "dump")
        d.wait_state("ready", 30)
        status = d.status()
        config = str(d.config_path)
        human = cli("status", "--config", config)
        listed = cli("incidents", "--config", config, "--json")
        shown = cli("incidents", "show", "last", "--config", config)
    last = status["last_restart"]
    inc = Path(last["incident"])
    assert inc.parent == tmp_path / "state" / "incidents"
    assert inc.name.endswith("-liveness_failed-launch1")
    assert stat.S_IMODE(inc.stat().st_mode) == 0o700
    doc = json.loads((inc / "incident.json").read_text())
    assert doc["reason"] == "liveness_failed" and doc["launch"] == 1
    assert doc["stacks"]["taken"] is True
    # Every process of the launch, each dumped while it was still alive.
    dumped = {p["pid"] for p in doc["stacks"]["processes"]}
    assert launch1 <= dumped and all(p["ok"] for p in doc["stacks"]["processes"]), doc["stacks"]
    assert taken["dumped"] == len(dumped) >= 3  # the main process and two tp ranks
    assert doc["server_info"]["tp_size"] == 2
    assert doc["timings"]["stack_dump_s"] is not None and doc["timings"]["ready_at"] is not None
    assert set(doc["timings"]["load_phases"]) >= {"init", "weights", "probe"}
    assert "decode_step_hung" in (inc / "stacks.txt").read_text()
    # On-call's view: the list (newest first), the hung frame in `show`, `status` names it.
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)[0]["id"] == inc.name
    assert shown.returncode == 0 and "decode_step_hung" in shown.stdout, shown.stdout
    assert human.returncode == 0 and f"kimi-serve incidents show {inc.name}" in human.stdout
    # The second launch loaded again: /status.last_load is that load's.
    assert status["last_load"]["complete"] is True
    assert status["last_load"]["phases"]["weights"] > 0


def test_a_dead_process_takes_no_dump(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path)) as d:
        d.wait_state("ready")
        os.kill(d.sglang_pid(), signal.SIGKILL)
        assert d.wait_state("restarting")["reason"] == "exited"
        d.wait_state("ready")
        status = d.status()
    assert not any(e.get("event") == "stacks taken before the kill" for e in d.seen)
    inc = Path(status["last_restart"]["incident"])
    doc = json.loads((inc / "incident.json").read_text())
    assert doc["reason"] == "exited" and doc["signal"] == 9
    assert doc["stacks"]["taken"] is False
    assert doc["stacks"]["reason"].startswith("process_gone")
    assert "# no stacks: process_gone" in (inc / "stacks.txt").read_text()


def test_a_requested_restart_leaves_no_incident(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path)) as d:
        d.wait_state("ready")
        assert d.post("/restart").status_code == 202
        assert d.wait_state("restarting")["reason"] == "manual"
        d.wait_state("ready")
        last = d.status()["last_restart"]
    assert last["reason"] == "manual" and "incident" not in last
    assert not (tmp_path / "state" / "incidents").exists() or not [
        p for p in (tmp_path / "state" / "incidents").iterdir() if not p.name.startswith(".")
    ]


def test_a_hanging_py_spy_does_not_hold_the_kill_past_the_budget(tmp_path: Path) -> None:
    budget = 2.0
    python = shadow_python(tmp_path, "exec sleep 600\n")
    with start_with(tmp_path, hang_config(tmp_path, f"{budget:g}s"), python) as d:
        d.wait_state("ready")
        took = restart_seconds(d)
        d.wait_state("ready", 30)
        inc = Path(d.status()["last_restart"]["incident"])
    # The budget is spent (py-spy never answers), then the kill goes ahead at once.
    assert budget <= took < budget + 3.0, took
    doc = json.loads((inc / "incident.json").read_text())
    assert doc["stacks"]["taken"] is False
    assert doc["stacks"]["reason"].startswith("timed_out"), doc["stacks"]


def test_without_py_spy_the_incident_says_why(tmp_path: Path) -> None:
    python = shadow_python(tmp_path, None)
    with start_with(tmp_path, hang_config(tmp_path), python) as d:
        d.wait_state("ready")
        assert restart_seconds(d) < 3.0
        d.wait_state("ready", 30)
        inc = Path(d.status()["last_restart"]["incident"])
    doc = json.loads((inc / "incident.json").read_text())
    assert doc["stacks"]["reason"].startswith("py_spy_missing"), doc["stacks"]
