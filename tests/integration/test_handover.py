"""Hand-over with the real daemon and the stand-in: `POST /reexec` execs a fresh kimi-serve
under the same PID, which adopts SGLang without relaunching it; what cannot be verified falls
back to an ordinary restart, saying why."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from testkit import BIN, base_config, running, wait_gone, wait_until
from testkit.daemon import DaemonProcess
from testkit.handover import Hammer, access_lines, liveness

pytestmark = pytest.mark.timeout(120)


def launches(tmp: Path) -> int:
    return int((tmp / "launches").read_text().strip())


def test_reexec_keeps_sglang_and_the_admin_port(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    sglang = f"http://127.0.0.1:{cfg['sglang']['port']}"
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        pid = d.sglang_pid()
        daemon_pid = d.proc.pid
        before = d.status()
        with Hammer(d.admin, sglang) as h:
            wait_until(lambda: h.sent > 20, 10, "the client loop running")
            r = d.post("/reexec")
            assert r.status_code == 202, r.text
            done = d.wait_for(lambda e: e.get("event") == "hand-over complete", timeout=30)
            assert done["state"] == "ready"
            wait_until(lambda: h.sent > 2 * 20 + 20, 10, "the client loop after the hand-over")
        assert set(h.codes) == {"200"}, h.codes  # never refused, never anything but ready
        assert h.failed == 0
        assert d.proc.pid == daemon_pid and d.proc.poll() is None
        status = d.status()
        assert status["child"]["pid"] == pid  # SGLang was not relaunched
        assert launches(tmp_path) == 1
        assert status["state"] == "ready"
        assert status["daemon"]["handoffs"] == 1
        assert status["daemon"]["last_handoff"]["outcome"] == "ok"
        metrics = d.get("/metrics").text
        assert 'kimi_serve_handoffs_total{outcome="ok"} 1.0' in metrics
        assert 'kimi_serve_handoffs_total{outcome="fallback"} 0.0' in metrics
        # The state's gauges and /status as they were, not those of a fresh start.
        assert "kimi_serve_ready 1.0" in metrics
        assert 'kimi_serve_state{state="ready"} 1.0' in metrics
        assert 'kimi_serve_state{state="starting"} 0.0' in metrics
        started = re.search(r"^kimi_serve_child_start_time_seconds (\S+)$", metrics, re.M)
        assert started and float(started[1]) == status["child"]["started_at"]
        # The one start, carried over the exec; none counted for the hand-over itself.
        assert "kimi_serve_child_starts_total 1.0" in metrics
        assert status["since"] == before["since"]
        assert status["events"][: len(before["events"])] == before["events"]
        assert d.stop() == 0
    # Every access line SGLang printed, once: none lost in the exec, none doubled.
    seen = access_lines(d)
    assert [n for n in range(1, h.sent + 1) if seen[n] != 1] == [], seen


def test_a_state_that_does_not_verify_falls_back_to_a_relaunch(tmp_path: Path) -> None:
    # The configuration now asks for another command line: the running SGLang is not what the
    # new daemon would launch, so it is stopped and relaunched, and the log says why.
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        old = psutil.Process(d.sglang_pid())
        cfg["sglang"]["args"]["max-running-requests"] = 8
        d.config_path.write_text(yaml.safe_dump(cfg))
        cli = subprocess.run(
            [str(BIN), "reexec", "--config", str(d.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.startswith("reexec accepted")
        why = d.wait_for(lambda e: "cannot adopt" in str(e.get("event")), timeout=30)
        assert "command line" in why["why"]
        d.wait_state("ready", timeout=30)
        assert not wait_gone([old], timeout=5)
        status = d.status()
        assert status["child"]["pid"] != old.pid
        assert "--max-running-requests" in psutil.Process(status["child"]["pid"]).cmdline()
        assert launches(tmp_path) == 2
        assert status["daemon"]["last_handoff"]["outcome"] == "fallback"
        assert "command line" in status["daemon"]["last_handoff"]["why"]
        assert status["child"]["launch"] == 2  # numbering goes on
        assert 'kimi_serve_handoffs_total{outcome="fallback"} 1.0' in d.get("/metrics").text
        # The next hand-over adopts; the fallback's count went on over this exec too (a
        # counter back at 0, then 1 again, would hide a second fallback from increase()).
        assert d.post("/reexec").status_code == 202
        d.wait_for(lambda e: e.get("event") == "hand-over complete", timeout=30)
        metrics = d.get("/metrics").text
        assert 'kimi_serve_handoffs_total{outcome="fallback"} 1.0' in metrics
        assert 'kimi_serve_handoffs_total{outcome="ok"} 1.0' in metrics
        assert d.status()["daemon"]["handoffs"] == 2
        assert d.stop() == 0


def test_a_stop_during_the_exec_waits_for_the_new_daemon_and_is_clean(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        procs = [psutil.Process(p) for p in d.status()["child"]["processes"]]
        assert d.post("/reexec").status_code == 202
        d.wait_for(lambda e: e.get("event") == "hand-over: exec", timeout=30)
        d.signal(signal.SIGTERM)  # blocked across the exec: the new daemon's handler gets it
        assert d.proc.wait(30) == 0
        assert not wait_gone(procs, timeout=5), "SGLang outlived the daemon"


def test_a_new_daemon_that_cannot_start_stops_sglang_instead_of_orphaning_it(
    tmp_path: Path,
) -> None:
    # The config was broken before the exec: the new daemon exits 78 as a start would, and
    # the SGLang it inherited, which nobody would own any more, is stopped with it.
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        procs = [psutil.Process(p) for p in d.status()["child"]["processes"]]
        d.config_path.write_text("sglang: [not, a, mapping\n")
        assert d.post("/reexec").status_code == 202
        assert d.proc.wait(60) == 78
        assert not wait_gone(procs, timeout=10), "SGLang outlived the daemon"
        assert any("hand-over abandoned" in line for line in d.raw), d.raw[-10:]


def test_reexec_is_refused_while_loading(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, sglang={"env": {"STANDIN_LOAD_SECONDS": "30"}})
    with running(tmp_path, cfg) as d:
        d.wait_state("loading")
        r = d.post("/reexec")
        assert r.status_code == 409
        assert "only while serving" in r.json()["error"]
        assert d.post("/reexec", token=False).status_code == 401
        assert d.stop() == 0


def test_a_keyed_sglang_is_handed_over_and_its_probes_keep_passing(tmp_path: Path) -> None:
    # sglang.api_key_file: the stand-in, like SGLang, answers 401 without the key. The new
    # daemon's probes carry the key the launch was given; the hand-over is ok only once a
    # decode succeeded, and SGLang is never relaunched (it was, 401 -> liveness_failed).
    key = tmp_path / "sglang.key"
    key.write_text("sk-handed-over\n")
    key.chmod(0o600)
    cfg = base_config(tmp_path, sglang={"api_key_file": str(key)})
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        pid = d.sglang_pid()
        assert d.post("/reexec").status_code == 202
        done = d.wait_for(lambda e: str(e.get("event")).startswith("hand-over"), timeout=30)
        while done["event"] != "hand-over complete":
            assert "fell back" not in done["event"] and "cannot adopt" not in done["event"], done
            assert "probe failed" not in done["event"], done
            done = d.wait_for(lambda e: str(e.get("event")).startswith("hand-over"), timeout=30)
        # More liveness probes than the failure threshold (2) after it, every one passing.
        before = liveness(d)[0]
        wait_until(lambda: liveness(d)[0] >= before + 4, 30, "4 more liveness probes")
        assert liveness(d)[1] == 0
        status = d.status()
        assert status["child"]["pid"] == pid and status["state"] == "ready"
        assert status["daemon"]["last_handoff"]["outcome"] == "ok"
        assert status["restarts"] == {}
        assert launches(tmp_path) == 1
        assert d.stop() == 0


def totals(d: DaemonProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter series in the daemon's /metrics."""
    out = {}
    for family in text_string_to_metric_families(d.get("/metrics").text):
        for sample in family.samples:
            if family.type == "counter" and sample.name.endswith("_total"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_restart_history_and_every_counter_go_on_across_a_hand_over(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        assert d.post("/restart").status_code == 202
        d.wait_for(lambda e: e.get("event") == "launched sglang", timeout=30)
        d.wait_state("ready", timeout=30)
        before, counts = d.status(), totals(d)
        assert before["restarts"] == {"manual": 1}
        assert counts[("kimi_serve_child_starts_total", ())] == 2
        assert d.post("/reexec").status_code == 202
        d.wait_for(lambda e: e.get("event") == "hand-over complete", timeout=30)
        after = d.status()
        assert after["restarts"] == {"manual": 1}  # `Restarts: 1 (manual 1)` still
        assert after["child"]["pid"] == before["child"]["pid"]
        now = totals(d)
        # No counter went back (a crash history hidden by an upgrade); none of ours is lost.
        went_back = {k: (v, now.get(k, 0.0)) for k, v in counts.items() if now.get(k, 0.0) < v}
        assert went_back == {}, went_back
        assert now[("kimi_serve_restarts_total", (("reason", "manual"),))] == 1
        assert now[("kimi_serve_child_starts_total", ())] == 2
        assert now[("kimi_serve_handoffs_total", (("outcome", "ok"),))] == 1
        assert d.stop() == 0
