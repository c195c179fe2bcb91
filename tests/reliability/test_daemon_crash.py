"""The daemon itself is SIGKILLed (OOM killer, a node agent, an operator's kill -9).

Outside systemd nothing kills SGLang with it. The next daemon on the same state directory
must find the previous launch's processes - from the launch record ((pid, create time) under
state_dir) and the owner marker in their environment - and remove them before launching; and a
recorded pid that now belongs to an unrelated process must be left alone.
(The plain case, SIGKILL while ready, is tests/integration/test_supervision.py.)
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor.process.identity import RECORD_FILE, LaunchRecord, ProcessIdentity, RecordStore
from testkit import base_config, free_port
from testkit.reliability import Trial, is_alive, is_event, is_state, supervised, trial
from testkit.wait import wait_until

pytestmark = pytest.mark.timeout(90)


def _recorded(state_dir: Path) -> set[int]:
    try:
        doc = json.loads((state_dir / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return set()
    return {int(p["pid"]) for p in doc.get("processes", [])}


def _second_daemon_sweeps(
    tmp: Path, cfg: dict[str, Any], old: list[psutil.Process], t: Trial
) -> None:
    """Start another daemon on the same state directory: it removes `old` before launching."""
    second = tmp / "second"
    second.mkdir()
    cfg = {**cfg, "admin": {"listen": f"127.0.0.1:{free_port()}"}}
    with supervised(second, cfg, t) as run:
        ev = run.d.wait_for(
            is_event("removing processes of an earlier launch"),
            timeout=30,
            what="the sweep of the earlier launch",
        )
        assert {p.pid for p in old} <= set(ev["pids"]), (ev["pids"], [p.pid for p in old])
        launching = run.d.wait_for(is_state("launching"), timeout=30, what="the launch")
        # Removed before anything new was launched, not merely eventually.
        left = [p.pid for p in old if is_alive(p)]
        t.orphans += len(left)
        assert not left, f"still alive when the new launch began: {left} ({launching})"
        run.d.wait_for(is_state("ready"), timeout=30, what="ready")
        t.recovered = True


def test_sigkill_of_the_daemon_while_loading(tmp_path: Path) -> None:
    # A 10-minute load, quiet for its first 12 s (the stand-in logs at fractions of the load):
    # the SGLang processes outlive the daemon instead of dying on a write to a closed pipe.
    cfg = base_config(tmp_path, sglang={"env": {"STANDIN_LOAD_SECONDS": "600"}})
    state_dir = Path(cfg["state_dir"])
    first = tmp_path / "first"
    first.mkdir()
    case = "SIGKILL of the daemon while loading"
    with trial("daemon crashes", case) as t, supervised(first, cfg, t) as run:
        run.d.wait_state("loading")
        # The scheduler and detokenizer children are recorded as they appear.
        wait_until(lambda: len(_recorded(state_dir)) >= 4, 10, "the children in the record", 0.05)
        old = [psutil.Process(pid) for pid in _recorded(state_dir)]
        run.d.proc.kill()
        run.d.proc.wait(5)
        assert all(is_alive(p) for p in old), "SGLang died with its supervisor"
        fast = {
            **cfg,
            "sglang": {
                **cfg["sglang"],
                "env": {**cfg["sglang"]["env"], "STANDIN_LOAD_SECONDS": "0.3"},
            },
        }
        _second_daemon_sweeps(tmp_path, fast, old, t)


def test_sigkill_of_the_daemon_with_escaped_children(tmp_path: Path) -> None:
    """orphans: SGLang's children left its process group; the next daemon still finds them."""
    cfg = base_config(
        tmp_path, sglang={"env": {"STANDIN_FAULT": "orphans", "STANDIN_FAULT_LAUNCH": "1"}}
    )
    first = tmp_path / "first"
    first.mkdir()
    case = "SIGKILL of the daemon, children escaped"
    with trial("daemon crashes", case) as t, supervised(first, cfg, t) as run:
        run.d.wait_state("ready")
        old = [psutil.Process(p) for p in run.status()["child"]["processes"]]
        assert len({p.pid for p in old}) >= 4
        run.d.proc.kill()
        run.d.proc.wait(5)
        assert all(is_alive(p) for p in old)
        _second_daemon_sweeps(tmp_path, cfg, old, t)


def test_a_stale_record_never_kills_a_reused_pid(tmp_path: Path) -> None:
    """The record names a pid that now belongs to an unrelated process (create time differs):
    that process survives; a recorded pid that no longer exists is no obstacle either."""
    cfg = base_config(tmp_path)
    unrelated = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        created = psutil.Process(unrelated.pid).create_time()
        store = RecordStore(cfg["state_dir"])
        store.save(
            LaunchRecord(
                daemon_pid=4_000_000,
                profile="primary",
                processes=(
                    ProcessIdentity(unrelated.pid, created - 3600.0),  # the pid, reused since
                    ProcessIdentity(4_194_000, created - 3600.0),  # long gone
                ),
            )
        )
        with (
            trial("daemon crashes", "stale launch record, pid reused") as t,
            supervised(tmp_path, cfg, t) as run,
        ):
            ev = run.d.wait_for(
                is_event("removing processes of an earlier launch"),
                timeout=30,
                what="the record being acted on",
            )
            assert unrelated.pid in ev["pids"]
            run.d.wait_state("ready")
            assert unrelated.poll() is None, "an unrelated process with a recorded pid was killed"
            assert run.status()["state"] == "ready"
            t.recovered = True
        assert unrelated.poll() is None
    finally:
        unrelated.send_signal(signal.SIGKILL)
        unrelated.wait(5)
