"""The on-call commands against the real daemon and the stand-in: `restart --wait` follows the
new launch to its outcome, `status` shows a load's progress, `--json` keeps the exit codes, and
`status` without a config file asks the default address."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import DEFAULT_CONFIG_PATH
from testkit import BIN, base_config, running
from testkit.cli import kimi_serve
from testkit.daemon import primary_crashes_config

pytestmark = pytest.mark.timeout(120)


def _wait(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`kimi-serve restart|undrain --wait ...`, whose output is not a terminal (one line per
    change of phase)."""
    env = {k: v for k, v in os.environ.items() if k != "KIMI_SERVE_CONFIG"}
    done = subprocess.run(
        [str(BIN), *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert "Traceback" not in done.stdout + done.stderr, done
    return done


def test_restart_wait_follows_the_new_launch_to_ready(tmp_path: Path) -> None:
    # A load long enough to be seen in phases: weights, then a captured graph, then ready.
    cfg = base_config(tmp_path, sglang={"env": {"STANDIN_LOAD_SECONDS": "3"}})
    with running(tmp_path, cfg) as d:
        d.wait_state("loading")
        # `status` while loading: the phase and the seconds used of load_timeout (20 s).
        shown = kimi_serve("status", "--config", str(d.config_path))
        assert shown.returncode == 3, shown
        (line,) = [ln for ln in shown.stdout.splitlines() if ln.startswith("   Loading: ")]
        assert "launch 1, phase " in line and "s of load_timeout 20 s (" in line, line
        d.wait_state("ready")
        old = d.status()["child"]["launch"]

        done = _wait("restart", "--wait", "--config", str(d.config_path))
        assert done.returncode == 0, done
        out = done.stdout.splitlines()
        assert out[0].startswith(f"restart accepted: launch {old + 1} on the primary profile")
        assert out[-1] == f"kimi-serve restart: ready (launch {old + 1}, profile primary)"
        progress = done.stderr.splitlines()
        # One line per change (not a terminal): the relaunch's load, phase by phase, with
        # its share of load_timeout, and no line twice in a row.
        loading = [ln for ln in progress if ln.startswith(f"loading (launch {old + 1}, primary)")]
        assert loading and all("s of load_timeout 20 s (" in ln for ln in loading), progress
        assert any("phase weights" in ln or "phase cuda_graph" in ln for ln in loading), progress
        assert all(a != b for a, b in itertools.pairwise(progress))
        assert progress[-1].startswith(f"ready (launch {old + 1}, primary), restarts 1")
        st = d.status()
        assert (st["state"], st["child"]["launch"], st["loading"]) == ("ready", old + 1, None)

        # --json: the answer with the wait's outcome, same exit status.
        done = _wait("restart", "--wait", "--json", "--config", str(d.config_path))
        assert done.returncode == 0, done
        doc = json.loads(done.stdout)
        assert (doc["accepted"], doc["launch"]) == (True, old + 2)
        assert doc["wait"]["exit"] == 0 and doc["wait"]["status"]["state"] == "ready"

        # A timeout shorter than the load: 3, and the line says where it stood.
        done = _wait("restart", "--wait", "--timeout", "1s", "--config", str(d.config_path))
        assert done.returncode == 3, done
        assert "kimi-serve restart: not ready after 1 s: " in done.stderr
        d.wait_state("ready")
        assert d.stop() == 0


def test_restart_wait_on_the_fallback_is_6(tmp_path: Path) -> None:
    with running(tmp_path, primary_crashes_config(tmp_path)) as d:
        d.wait_for(lambda e: e.get("event") == "state" and e.get("new") == "ready", 60, "ready")
        assert d.status()["profile"] == "fallback"
        # Back to primary, which still crashes: the crash loop sends it to the fallback again.
        done = _wait("restart", "--wait", "--config", str(d.config_path))
        assert done.returncode == 6, done
        assert "ready on the fallback profile (launch " in done.stderr
        assert d.stop() == 0


def test_restart_wait_into_a_crash_loop_is_1_with_the_incident(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path,
        sglang={"env": {"STANDIN_FAULT": "crash-during-load"}},
        restart={"crash_loop": {"max_restarts": 2, "window": "1h"}, "fallback_profile": None},
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("failed", timeout=60)
        done = _wait("restart", "--wait", "--config", str(d.config_path))
        assert done.returncode == 1, done
        last = done.stderr.splitlines()[-1]
        st: dict[str, Any] = d.status()
        incident = Path(st["last_restart"]["incident"]).name
        assert last.startswith("kimi-serve restart: failed: "), last
        assert f"incident {incident} (kimi-serve incidents show {incident})" in last
        assert d.stop() == 0


def test_drain_and_undrain_speak_like_status_and_json(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path)) as d:
        d.wait_state("ready")
        config = str(d.config_path)
        done = kimi_serve("drain", "--config", config)
        assert done.returncode == 0, done
        assert done.stdout.splitlines()[0] == "● drain done"
        assert "    Router: router.url is not set" in done.stdout
        assert " In flight: none (idle after " in done.stdout
        d.wait_state("draining")
        done = _wait("undrain", "--wait", "--json", "--config", config)
        assert done.returncode == 0, done
        doc = json.loads(done.stdout)
        assert doc["undrained"] is True and doc["wait"]["status"]["state"] == "ready"
        # Not draining: nothing to undo, exit 0, said so (JSON on stdout with --json).
        done = kimi_serve("undrain", "--json", "--config", config)
        assert done.returncode == 0, done
        answer = json.loads(done.stdout)
        assert answer["undrained"] is False and answer["already"].startswith("not draining")
        done = kimi_serve("undrain", "--config", config)
        assert done.returncode == 0, done
        assert done.stdout.startswith("● undrain: nothing to do: not draining: ready"), done
        assert d.status()["state"] == "ready"
        assert d.stop() == 0


def test_status_without_a_config_file_asks_the_default_address(tmp_path: Path) -> None:
    missing = Path(DEFAULT_CONFIG_PATH)
    if missing.exists():
        pytest.skip(f"{missing} exists here")
    env = {k: v for k, v in os.environ.items() if k != "KIMI_SERVE_CONFIG"}
    done = subprocess.run([str(BIN), "status"], capture_output=True, text=True, timeout=30, env=env)
    # Nobody listens on 127.0.0.1:29400 here (or someone else does): 4, never 78.
    assert done.returncode in (0, 3, 4), done
    assert f"no config file {missing}; asking http://127.0.0.1:29400" in done.stderr
    assert "/var/lib/kimi-serve/admin.token" in done.stderr


def test_a_malformed_token_file_is_an_error(tmp_path: Path) -> None:
    bad = tmp_path / "admin.token"
    bad.write_text("short\n")
    bad.chmod(0o600)
    done = kimi_serve("status", "--url", "http://127.0.0.1:9", "--token-file", str(bad))
    assert done.returncode == 77, done
    assert f"admin token file {bad} does not hold a usable token" in done.stderr
    done = kimi_serve("restart", "--url", "http://127.0.0.1:9", "--token-file", str(bad))
    assert done.returncode == 77, done


def test_status_watch_follows_a_load_without_starting_one(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, sglang={"env": {"STANDIN_LOAD_SECONDS": "2"}})
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        # Serving already: the watch ends at once, and nothing was asked of the daemon.
        done = _wait("status", "--watch", "--config", str(d.config_path))
        assert done.returncode == 0, done
        assert done.stdout.strip() == "kimi-serve status: ready (launch 1, profile primary)"
        assert d.status()["child"]["launch"] == 1
        # A restart accepted without --wait names the watch as the way to follow it.
        accepted = kimi_serve("restart", "--config", str(d.config_path))
        assert accepted.returncode == 0, accepted
        assert "follow it with `kimi-serve status --watch`" in accepted.stdout
        d.wait_state("loading")
        done = _wait("status", "--watch", "--config", str(d.config_path))
        assert done.returncode == 0, done
        assert done.stdout.strip() == "kimi-serve status: ready (launch 2, profile primary)"
        assert any(ln.startswith("loading (launch 2, primary)") for ln in done.stderr.splitlines())
        # Following it started nothing: one restart, the one asked for.
        status = d.status()
        assert status["child"]["launch"] == 2
        assert sum(status["restarts"].values()) == 1


def test_status_watch_ends_on_failed_and_on_its_timeout(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path,
        sglang={"env": {"STANDIN_FAULT": "crash-during-load"}},
        restart={"crash_loop": {"max_restarts": 2, "window": "1h"}},
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("failed", timeout=60)
        done = _wait("status", "--watch", "--config", str(d.config_path))
        assert done.returncode == 1, done
        assert done.stderr.splitlines()[-1].startswith("kimi-serve status: failed: ")
    slow = tmp_path / "slow"
    slow.mkdir()
    cfg = base_config(slow, sglang={"env": {"STANDIN_LOAD_SECONDS": "60"}})
    with running(slow, cfg) as d:
        d.wait_state("loading")
        done = _wait("status", "--watch", "--timeout", "1s", "--config", str(d.config_path))
        assert done.returncode == 3, done
        assert "not ready after 1 s" in done.stderr
