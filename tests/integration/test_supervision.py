"""The supervision core against the stand-in, all real processes: the daemon, SGLang's stand-in
and its scheduler children, signals, loopback HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from testkit import (
    BIN,
    base_config,
    owned_processes,
    running,
    wait_gone,
)
from testkit.daemon import primary_crashes_config

pytestmark = pytest.mark.timeout(90)


def fault(name: str, launch: int | None = 1, **extra: str) -> dict[str, Any]:
    env = {"STANDIN_FAULT": name, **extra}
    if launch is not None:
        env["STANDIN_FAULT_LAUNCH"] = str(launch)
    return {"env": env}


def test_ready_only_after_a_decode(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path)) as d:
        d.wait_state("loading")
        assert d.get("/readyz").status_code == 503
        ready = d.wait_state("ready")
        assert ready["reason"] == "probe_ok"
        # The order is the contract's: warming (decode probe) comes before ready.
        assert d.states()[-3:] == ["loading", "warming", "ready"]
        assert d.get("/readyz").status_code == 200
        assert d.get("/livez").status_code == 200
        st = d.status()
        assert st["state"] == "ready"
        assert st["last_probe"]["ok"] is True
        assert st["last_probe"]["completion_tokens"] == 8
        assert st["child"]["pid"] > 0
        # The scheduler and detokenizer children were recorded as they appeared.
        assert len(st["child"]["processes"]) >= 3
        metrics = d.get("/metrics").text
        assert 'kimi_serve_state{state="ready"} 1.0' in metrics
        assert "kimi_serve_ready 1.0" in metrics
        assert "kimi_serve_child_starts_total 1.0" in metrics
        assert d.stop() == 0
    assert d.states()[-2:] == ["stopping", "stopped"]


def test_seed_incident_is_never_ready_and_recovers(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, sglang=fault("seed-incident"))
    with running(tmp_path, cfg) as d:
        restart = d.wait_state("restarting")
        assert restart["reason"] in ("fatal_log", "readiness_failed")
        # Nothing said ready during the broken launch.
        assert "ready" not in d.states()
        d.wait_state("ready")
        st = d.status()
        last = st["last_restart"]
        assert last["reason"] == restart["reason"]
        tail = "\n".join(last["log_tail"])
        assert "AttributeError: 'EAGLEWorkerV2' object has no attribute" in tail
        assert "spec_disable_batch_threshold" in tail
        assert st["restarts"] == {restart["reason"]: 1}
        if restart["reason"] == "fatal_log":
            # The detail is the line on-call needs, not the pattern that matched.
            assert last["detail"].startswith("AttributeError: 'EAGLEWorkerV2'")
        metrics = d.get("/metrics").text
        assert f'kimi_serve_restarts_total{{reason="{restart["reason"]}"}} 1.0' in metrics
        # Without the admin token: the reason and counts, none of SGLang's text.
        open_doc = d.get("/status").json()
        assert open_doc["last_restart"]["reason"] == restart["reason"]
        assert open_doc["restarts"] == st["restarts"]
        assert "EAGLEWorkerV2" not in json.dumps(open_doc) and "log_tail" in open_doc["redacted"]
        # What on-call types: the human summary names the reason and shows the traceback.
        out = subprocess.run(
            [str(BIN), "status", "--config", str(d.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert f"Last restart: {restart['reason']}" in out.stdout
        assert "AttributeError: 'EAGLEWorkerV2' object has no attribute" in out.stdout
        assert "State: ready" in out.stdout


@pytest.mark.parametrize(
    ("name", "reason"),
    [("decode-500", "http_status"), ("decode-zero-tokens", "too_few_tokens")],
)
def test_broken_decode_before_ready(tmp_path: Path, name: str, reason: str) -> None:
    cfg = base_config(tmp_path, sglang=fault(name))
    with running(tmp_path, cfg) as d:
        ev = d.wait_state("restarting")
        assert ev["reason"] == "readiness_failed"
        assert "ready" not in d.states()
        d.wait_state("ready")
        metrics = d.get("/metrics").text
        assert f'kimi_serve_probe_failures_total{{kind="readiness",reason="{reason}"}}' in metrics


def test_hang_after_ready_is_liveness_failed(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, sglang=fault("decode-hang"))
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        d.wait_state("degraded")
        ev = d.wait_state("restarting")
        assert ev["reason"] == "liveness_failed"
        d.wait_state("ready")
        assert d.status()["restarts"] == {"liveness_failed": 1}


def test_busy_server_is_not_restarted(tmp_path: Path) -> None:
    # Every decode after the readiness probe and its canary takes 30 s while the token counter
    # advances: busy.
    cfg = base_config(
        tmp_path,
        sglang=fault(
            "slow-decode",
            launch=None,
            STANDIN_SLOW_DECODE_SECONDS="30",
            STANDIN_SLOW_AFTER_DECODES="2",
        ),
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        # Wait for several liveness probes to time out and be judged busy.
        for _ in range(3):
            d.wait_for(
                lambda e: e.get("event") == "probe failed" and e.get("kind") == "liveness",
                timeout=10,
                what="a timed-out liveness probe",
            )
        failed = [e for e in d.seen if e.get("event") == "probe failed"]
        assert all(e["busy"] for e in failed), failed
        assert "restarting" not in d.states()
        assert d.status()["state"] == "ready"


def test_sigkill_of_sglang_restarts_with_exited(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path)) as d:
        d.wait_state("ready")
        first = d.status()["child"]
        children = [psutil.Process(p) for p in first["processes"]]
        os.kill(first["pid"], signal.SIGKILL)
        ev = d.wait_state("restarting")
        assert ev["reason"] == "exited"
        d.wait_state("ready")
        last = d.status()["last_restart"]
        assert last["reason"] == "exited" and last["signal"] == signal.SIGKILL
        assert not wait_gone(children, timeout=5), "a process of the first launch survived"
        exited = [e for e in d.seen if e.get("event") == "sglang exited"]
        assert exited[0]["process"] == "main" and exited[0]["signal"] == signal.SIGKILL


def test_a_config_without_spt_noenv_is_warned_at_start(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)  # the stand-in's config sets no SPT_NOENV
    with running(tmp_path, cfg) as d:
        warned = d.wait_for(
            lambda e: "SPT_NOENV" in str(e.get("event")), what="the SPT_NOENV warning"
        )
        assert warned["level"] == "warning" and "sglang.env" in warned["event"]
        d.wait_state("ready")


def test_orphaned_children_are_swept(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, sglang=fault("orphans"))
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        first = d.status()["child"]
        main = psutil.Process(first["pid"])
        escaped = [psutil.Process(p) for p in first["processes"] if p != first["pid"]]
        assert escaped
        # The children left SGLang's process group: a killpg alone would miss them.
        assert any(os.getpgid(p.pid) != os.getpgid(main.pid) for p in escaped)
        main.kill()
        d.wait_state("restarting")
        d.wait_state("ready")
        assert not wait_gone(escaped, timeout=5), "an orphan of the first launch survived"


def test_crash_loop_without_fallback_fails_and_stays_up(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path,
        sglang=fault("crash-during-load", launch=None),
        restart={"crash_loop": {"max_restarts": 3, "window": "1h"}, "fallback_profile": None},
    )
    with running(tmp_path, cfg) as d:
        ev = d.wait_state("failed")
        assert ev["reason"] == "crash_loop"
        st = d.status()
        assert st["state"] == "failed" and st["child"] is None
        # The crash prints a scheduler traceback, then exits: whichever is seen first names it.
        assert sum(st["restarts"].values()) == 3
        assert set(st["restarts"]) <= {"exited", "fatal_log"}
        assert d.get("/readyz").status_code == 503
        metrics = d.get("/metrics").text
        assert 'kimi_serve_state{state="failed"} 1.0' in metrics
        assert "kimi_serve_child_starts_total 3.0" in metrics
        # It relaunches nothing: a manual restart, or a reload, is the way out.
        assert d.post("/restart", token=False).status_code == 401
        r = d.post("/restart")
        assert r.status_code == 202
        d.wait_state("cleaning")
        d.wait_state("failed")  # the fault is on every launch: the same crash loop again
        # A reload with the file unchanged (the operator fixed the host) relaunches too.
        d.signal(signal.SIGHUP)
        ev = d.wait_state("cleaning")
        assert ev["reason"] == "reload"
        assert d.stop() == 0


def test_crash_loop_switches_to_fallback(tmp_path: Path) -> None:
    with running(tmp_path, primary_crashes_config(tmp_path)) as d:
        d.wait_for(lambda e: e.get("event") == "profile changed", what="profile change")
        d.wait_state("ready")
        st = d.status()
        assert st["profile"] == "fallback"
        metrics = d.get("/metrics").text
        assert 'kimi_serve_profile_info{profile="fallback"} 1.0' in metrics
        assert 'kimi_serve_profile_info{profile="primary"} 0.0' in metrics


def test_stop_during_load(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, sglang=fault("never-ready", launch=None))
    with running(tmp_path, cfg) as d:
        d.wait_state("loading")
        d.wait_for(lambda e: e.get("source") == "sglang", what="a line from SGLang")
        assert d.stop(timeout=15) == 0
        assert not owned_processes(d.owner)


def test_sigterm_ignored_escalates_to_sigkill(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path, sglang=fault("ignore-sigterm", launch=None), stop={"drain_timeout": "1s"}
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        procs = [psutil.Process(p) for p in d.status()["child"]["processes"]]
        assert d.stop(timeout=20) == 0
        assert not wait_gone(procs, timeout=2)


def test_log_flood_keeps_the_daemon_responsive(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path, sglang=fault("log-flood", launch=None, STANDIN_FLOOD_LINES="100000")
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready", timeout=40)
        assert d.get("/livez").status_code == 200
        metrics = d.get("/metrics").text
        lines = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("kimi_serve_log_lines_total{")
        )
        assert lines >= 100000


def test_reload_restarts_on_change_and_keeps_running_on_bad_config(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        # Invalid: the daemon keeps running on the old configuration.
        good = d.config_path.read_text()
        d.config_path.write_text("sglang: [not, a, mapping]\n")
        d.signal(signal.SIGHUP)
        d.wait_for(lambda e: e.get("event", "").startswith("reload refused"), what="refusal")
        assert d.status()["state"] == "ready"
        # Unchanged: nothing happens.
        d.config_path.write_text(good)
        d.signal(signal.SIGHUP)
        d.wait_for(lambda e: "unchanged" in e.get("event", ""), what="unchanged reload")
        # Changed: restart with reason reload.
        cfg["liveness"]["interval"] = "0.7s"
        d.config_path.write_text(yaml.safe_dump(cfg))
        d.signal(signal.SIGHUP)
        ev = d.wait_state("restarting")
        assert ev["reason"] == "reload"
        d.wait_state("ready")
        assert d.status()["restarts"] == {"reload": 1}


def test_a_reload_keeps_the_running_launch_s_log_tail(tmp_path: Path) -> None:
    # A reload that relaunches nothing must not empty the tail: a crash after it is reported
    # with what SGLang printed before the reload too.
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        d.signal(signal.SIGHUP)
        d.wait_for(lambda e: "unchanged" in e.get("event", ""), what="unchanged reload")
        os.kill(d.sglang_pid(), signal.SIGKILL)
        ev = d.wait_state("restarting")
        assert ev["reason"] == "exited"
        tail = d.status()["last_restart"]["log_tail"]
        # The stand-in's lines from its start, long before the reload (its model load).
        assert any("Load weight" in line for line in tail), tail


def test_daemon_sigkill_then_restart_finds_previous_launch(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    path = tmp_path / "first"
    path.mkdir()
    with running(path, cfg) as first:
        first.wait_state("ready")
        old = [psutil.Process(p) for p in first.status()["child"]["processes"]]
        first.proc.kill()
        first.proc.wait(5)
        # SGLang outlives its SIGKILLed supervisor (nothing kills it: no cgroup here).
        assert all(p.is_running() for p in old)
        second_dir = tmp_path / "second"
        second_dir.mkdir()
        with running(second_dir, cfg) as second:
            ev = second.wait_for(
                lambda e: e.get("event") == "removing processes of an earlier launch",
                what="leftover sweep",
            )
            assert set(ev["pids"]) >= {p.pid for p in old}
            second.wait_state("ready")
            assert not wait_gone(old, timeout=5)


def test_bad_config_exits_78(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("sglang:\n  model_path: /m\n  port: 99999\n")
    r = subprocess.run(
        [str(BIN), "run", "--config", str(path)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 78
    assert "sglang.port" in r.stderr and ":3:" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
