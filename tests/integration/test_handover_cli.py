"""`kimi-serve reexec --wait` and `status` against the real daemon and the stand-in: the wait
follows the hand-over across the exec (the admin port is inherited, so every poll is answered,
at worst slowly) to the new program serving, says when it fell back to a restart (8, with
why), and a hand-over asked for during a load is refused with a clear answer (1)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from testkit import BIN, base_config, running

pytestmark = pytest.mark.timeout(120)


def kimi(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KIMI_SERVE_CONFIG"}
    done = subprocess.run(
        [str(BIN), *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert "Traceback" not in done.stdout + done.stderr, done
    return done


def test_reexec_wait_follows_the_hand_over_to_ready_and_status_shows_it(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        sglang = d.sglang_pid()
        before = d.status()["daemon"]
        done = kimi("reexec", "--wait", "--timeout", "60s", "--config", str(d.config_path))
        assert done.returncode == 0, done
        out = done.stdout.splitlines()
        assert out[0].startswith("reexec accepted")
        assert re.fullmatch(
            r"kimi-serve reexec: ready: handed over from kimi-serve \S+ to \S+ in [\d.]+ s "
            rf"\(pid {d.proc.pid}\); SGLang kept running \(launch 1, profile primary\)",
            out[-1],
        ), out
        # Progress on stderr, one line per change: the last names the hand-over done.
        assert "1 hand-over" in done.stderr.splitlines()[-1], done.stderr
        st = d.status()
        assert st["child"]["pid"] == sglang and st["daemon"]["handoffs"] == 1
        assert st["daemon"]["started_at"] == before["started_at"]  # uptime across the exec
        # `status` beside SGLang's: the daemon's version, uptime and the hand-over.
        shown = kimi("status", "--config", str(d.config_path))
        assert shown.returncode == 0, shown
        lines = shown.stdout.splitlines()
        daemon = next(x for x in lines if x.strip().startswith("Daemon:"))
        assert re.search(
            rf"Daemon: kimi-serve \S+, pid {d.proc.pid}, up \d+ s; 1 hand-over, the last ok in "
            r"[\d.]+ s from \S+, \d+ s ago",
            daemon,
        ), daemon
        sglang_line = next(x for x in lines if x.strip().startswith("SGLang:"))
        assert re.search(rf"SGLang: pid {sglang}, up \d+ s \(\d+ processes\)", sglang_line)
        assert lines[0].startswith("● kimi-serve ") and " - SGLang " in lines[0]
        # --json: the answer with the wait's outcome, the same exit status.
        done = kimi("reexec", "--wait", "--json", "--config", str(d.config_path))
        assert done.returncode == 0, done
        doc = json.loads(done.stdout)
        assert doc["accepted"] is True and doc["daemon"]["handoffs"] == 1
        assert doc["wait"]["exit"] == 0 and doc["wait"]["status"]["daemon"]["handoffs"] == 2
        assert d.stop() == 0


def test_reexec_wait_that_falls_back_is_8_with_the_reason(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        old = d.sglang_pid()
        cfg["sglang"]["args"]["max-running-requests"] = 8
        d.config_path.write_text(yaml.safe_dump(cfg))
        done = kimi("reexec", "--wait", "--timeout", "60s", "--config", str(d.config_path))
        assert done.returncode == 8, done
        said = done.stderr.splitlines()[-1]  # not as asked: on stderr, as 6 and 7 are
        assert said.startswith(
            "kimi-serve reexec: ready, but the hand-over fell back to a restart: the "
            "configuration changes SGLang's command line"
        ), said
        assert said.endswith("(launch 2, profile primary)"), said
        st = d.status()
        assert st["state"] == "ready" and st["child"]["pid"] != old
        assert d.stop() == 0


def test_reexec_during_a_load_is_refused_with_a_clear_answer(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, sglang={"env": {"STANDIN_LOAD_SECONDS": "30"}})
    with running(tmp_path, cfg) as d:
        d.wait_state("loading")
        for wait in ([], ["--wait"]):
            done = kimi("reexec", *wait, "--config", str(d.config_path))
            assert done.returncode == 1, done
            assert done.stderr.strip() == (
                "kimi-serve reexec: HTTP 409: the daemon hands over only while serving "
                "(ready, degraded, draining); it is loading: try again once ready, or use "
                "restart"
            ), done.stderr
        st = d.status()
        assert st["state"] == "loading" and st["daemon"]["handoffs"] == 0
        assert st["daemon"]["last_handoff"] is None  # refused: no hand-over, none counted
        assert 'kimi_serve_handoffs_total{outcome="failed"} 0.0' in d.get("/metrics").text
        assert d.stop() == 0
