"""GPU fitness and leftovers through the real daemon: `kimi-serve run` supervising the stand-in
on simulated GPUs (supervisor/gpu/sim.py), whose faults a test sets in a file while it runs.

- A GPU that needs a reset before a launch: `failed` with the one line, nothing launched.
- An Xid event while serving: counted and shown, no restart; a lost GPU or a recovery action
  asked for while serving: SGLang restarted with reason gpu_fault.
- The daemon SIGKILLed with a launch running: the next daemon counts every orphan, with its
  GPU, and lists it in /status.leftovers.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.gpu.sim import (
    ENV_GPUS,
    ENV_HEALTH,
    ENV_TAG,
    ENV_XID_FILE,
    simulated_uuid,
)
from testkit import base_config, free_port, running
from testkit.daemon import BIN, DaemonProcess

pytestmark = pytest.mark.timeout(90)


def sim_env(tmp: Path, health: str = "") -> dict[str, str]:
    (tmp / "health").write_text(health)
    (tmp / "xids").write_text("")
    return {
        ENV_GPUS: "2",
        ENV_TAG: f"fitness-daemon-{uuid.uuid4().hex[:12]}",
        ENV_HEALTH: f"@{tmp / 'health'}",
        ENV_XID_FILE: str(tmp / "xids"),
    }


def samples(d: DaemonProcess, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(d.get("/metrics").text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def metric(d: DaemonProcess, name: str, **labels: str) -> float | None:
    for key, value in samples(d, name).items():
        if all(dict(key).get(k) == v for k, v in labels.items()):
            return value
    return None


def eventually(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def launches(tmp: Path) -> int:
    counter = tmp / "launches"
    return len(counter.read_text().split()) if counter.exists() else 0


def test_a_gpu_needing_a_reset_fails_before_any_launch(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, gpus={"manage": True})
    env = sim_env(tmp_path, "1:remap_pending")
    uuid1 = simulated_uuid(1)
    with running(tmp_path, cfg, env=env) as d:
        ev = d.wait_state("failed")
        assert ev["reason"] == "gpu_unfit"
        assert ev["detail"].startswith(f"GPU 1 ({uuid1}) needs a reset: row remapping pending")
        assert "launching" not in d.states() and launches(tmp_path) == 0
        assert metric(d, "kimi_serve_gpu_healthy", gpu="1", UUID=uuid1) == 0
        assert metric(d, "kimi_serve_gpu_healthy", gpu="0", UUID=simulated_uuid(0)) == 1
        health = {g["index"]: g["health"] for g in d.status()["gpus"]}
        assert health[1]["ok"] is False and health[1]["action"] == "reset"
        assert health[0]["ok"] is True
        r = subprocess.run(
            [str(BIN), "status", "--config", str(d.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 3, r.stdout + r.stderr
        assert f"Detail: GPU 1 ({uuid1}) needs a reset: row remapping pending" in r.stdout
        assert f"GPU 1: {uuid1} 0 MiB used, 0 processes, NEEDS A RESET" in r.stdout, r.stdout
        # Failed is final: nothing relaunches onto the GPU.
        assert launches(tmp_path) == 0 and d.states()[-1] == "failed"


def test_an_xid_while_serving_is_reported_without_a_restart(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, gpus={"manage": True})
    env = sim_env(tmp_path)
    with running(tmp_path, cfg, env=env) as d:
        d.wait_state("ready")
        pid = d.sglang_pid()
        with (tmp_path / "xids").open("a") as f:
            f.write("1:13\n")
        ev = d.wait_for(lambda e: e.get("event") == "gpu fault", what="the Xid report")
        assert ev["restart"] is False
        assert "GPU 1" in ev["line"] and "Xid 13" in ev["line"], ev
        uuid1 = simulated_uuid(1)
        assert metric(d, "kimi_serve_gpu_xid_events_total", gpu="1", UUID=uuid1, xid="13") == 1

        def last_xid() -> Any:
            return {g["index"]: g["health"] for g in d.status()["gpus"]}[1]["last_xid"]

        got = eventually("/status last_xid", last_xid)
        assert got["xid"] == 13
        doc = d.status()
        assert doc["state"] == "ready" and doc["child"]["pid"] == pid
        assert "gpu_fault" not in doc["restarts"]
        # The watcher is cancelled and its event set closed before NVML: a clean stop.
        assert d.stop() == 0
        assert not [line for line in d.raw if "internal" in line or "Traceback" in line]


@pytest.mark.parametrize("fault", ["0:lost", "0:recovery=1"])
def test_a_lost_gpu_or_a_recovery_action_while_serving_restarts(tmp_path: Path, fault: str) -> None:
    cfg = base_config(tmp_path, gpus={"manage": True})
    env = sim_env(tmp_path)
    with running(tmp_path, cfg, env=env) as d:
        d.wait_state("ready")
        (tmp_path / "health").write_text(fault)
        with (tmp_path / "xids").open("a") as f:
            f.write("0:79\n" if fault.endswith("lost") else "0:48\n")
        ev = d.wait_state("restarting")
        assert ev["reason"] == "gpu_fault" and f"GPU 0 ({simulated_uuid(0)})" in ev["detail"]
        # The GPU still needs the action at the next cleaning: failed, not relaunched.
        failed = d.wait_state("failed")
        assert failed["reason"] == "gpu_unfit"
        assert launches(tmp_path) == 1
        assert d.status()["restarts"] == {"gpu_fault": 1}
        assert metric(d, "kimi_serve_restarts_total", reason="gpu_fault") == 1


def test_a_recovery_action_with_no_event_is_found_while_serving(tmp_path: Path) -> None:
    # The driver may raise no critical event for it: the periodic read finds it
    # (fitness_watch.HEALTH_POLL_S), and a GPU outside the fault reads fit throughout.
    cfg = base_config(tmp_path, gpus={"manage": True})
    env = sim_env(tmp_path)
    with running(tmp_path, cfg, env=env) as d:
        d.wait_state("ready")
        (tmp_path / "health").write_text("1:recovery=1")
        ev = d.wait_state("restarting", 30)
        assert ev["reason"] == "gpu_fault", ev
        assert ev["detail"].startswith(f"GPU 1 ({simulated_uuid(1)}) needs a reset"), ev
        assert d.wait_state("failed")["reason"] == "gpu_unfit"
        assert metric(d, "kimi_serve_gpu_healthy", gpu="1", UUID=simulated_uuid(1)) == 0
        assert metric(d, "kimi_serve_gpu_healthy", gpu="0", UUID=simulated_uuid(0)) == 1
        assert d.status()["restarts"] == {"gpu_fault": 1}


@pytest.mark.slow
def test_orphans_of_a_sigkilled_daemon_are_counted_with_their_gpus(tmp_path: Path) -> None:
    # A long load, quiet at first: SGLang's processes outlive the daemon (no write to a closed
    # pipe kills them), holding their simulated GPU memory.
    slow = base_config(
        tmp_path, gpus={"manage": True}, sglang={"env": {"STANDIN_LOAD_SECONDS": "600"}}
    )
    env = sim_env(tmp_path)
    with running(tmp_path, slow, env=env) as first:
        first.wait_state("loading")
        status = eventually(
            "the schedulers on the GPUs",
            lambda: (s := first.status())["gpus"] and all(g["processes"] for g in s["gpus"]) and s,
        )
        old = [psutil.Process(p) for p in status["child"]["processes"]]
        first.proc.kill()
        first.proc.wait(5)
        assert all(p.is_running() for p in old), "SGLang died with its supervisor"
        fast = {
            **slow,
            "sglang": {**slow["sglang"], "env": {**slow["sglang"]["env"]}},
            "admin": {"listen": f"127.0.0.1:{free_port()}"},
        }
        fast["sglang"]["env"]["STANDIN_LOAD_SECONDS"] = "0.3"
        second_dir = tmp_path / "second"
        second_dir.mkdir()
        with running(second_dir, fast, env=env) as second:
            second.wait_state("ready")
            for i in (0, 1):
                killed = metric(
                    second,
                    "kimi_serve_gpu_leftover_processes_killed_total",
                    gpu=str(i),
                    UUID=simulated_uuid(i),
                )
                assert killed is not None and killed >= 1, (i, killed)
            total = sum(samples(second, "kimi_serve_gpu_leftover_processes_killed_total").values())
            left = second.status()["leftovers"]
            pids = {p["pid"] for p in left["processes"]}
            assert pids >= {p.pid for p in old}, (pids, [p.pid for p in old])
            assert sum(left["killed"].values()) == total >= len(old)
            assert {g for p in left["processes"] for g in p["gpus"]} == {0, 1}
            r = subprocess.run(
                [str(BIN), "status", "--config", str(second.config_path)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert f"Leftovers: {int(total)} killed before the last launch (GPU 0: " in r.stdout, (
                r.stdout
            )
            assert all(not p.is_running() or p.status() == "zombie" for p in old)
