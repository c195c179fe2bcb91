"""restart.mode: exit with the real daemon and the stand-in: an unasked restart ends in a clean
exit 75 (nothing of SGLang left, not relaunched); a requested restart still relaunches in place."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from supervisor.core.machine import EX_RESTART_BY_ORCHESTRATOR
from testkit import base_config, owned_processes, running, wait_gone

pytestmark = pytest.mark.timeout(90)


def launches(tmp: Path) -> int:
    return int((tmp / "launches").read_text().strip())


def test_sglang_killed_cleans_up_and_exits_75_without_relaunching(tmp_path: Path) -> None:
    # `orphans`: the stand-in's children leave its process group, as an SGLang child killed
    # before PR_SET_PDEATHSIG would: the cleaning before the exit must still find them.
    cfg = base_config(
        tmp_path,
        sglang={"env": {"STANDIN_FAULT": "orphans", "STANDIN_FAULT_LAUNCH": "1"}},
        restart={"mode": "exit"},
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        first = d.status()["child"]
        procs = [psutil.Process(p) for p in first["processes"]]
        assert len(procs) > 1
        os.kill(first["pid"], signal.SIGKILL)
        assert d.wait_state("restarting")["reason"] == "exited"
        stopping = d.wait_state("stopping")
        assert stopping["reason"] == "restart_mode_exit"
        assert stopping["detail"].startswith("exited: killed by signal 9")
        stopped = d.wait_state("stopped")
        assert stopped["reason"] == "restart_mode_exit"
        assert d.proc.wait(20) == EX_RESTART_BY_ORCHESTRATOR == 75
        assert not wait_gone(procs, timeout=5), "a process of the launch outlived the daemon"
        assert not owned_processes(d.owner)
        assert launches(tmp_path) == 1  # never relaunched alone
        assert "cleaning" not in d.states()[d.states().index("restarting") :]


def test_a_requested_restart_still_relaunches_in_place(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, restart={"mode": "exit"})
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        r = d.post("/restart")  # with the admin token
        assert r.status_code == 202
        assert d.wait_state("restarting")["reason"] == "manual"
        d.wait_state("cleaning")
        d.wait_state("ready")
        assert d.proc.poll() is None
        assert launches(tmp_path) == 2
        assert d.stop() == 0
