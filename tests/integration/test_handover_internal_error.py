"""An internal error of the daemon's own code, with the real daemon and the stand-in: the daemon
records an incident with its traceback, execs a fresh kimi-serve under the same PID that adopts
the running SGLang (same pid, ready again, counted `ok`), whether the error was raised in a task
or in the loop's own dispatch of an event; and it is bounded: after 3 within the hour the old
path, SGLang stopped and exit 1.

No input from outside is known to raise one (supervisor/daemon/injected.py says why), so the
error is injected: `KIMI_SERVE_TEST_INTERNAL_ERROR` names a file whose text says where."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor.daemon import injected
from supervisor.daemon.handover import RECOVER_MAX
from testkit import BIN, base_config, running, wait_gone

pytestmark = pytest.mark.timeout(150)


def inject(fault: Path, where: str) -> None:
    staged = fault.with_name(fault.name + ".new")
    staged.write_text(where)
    staged.rename(fault)  # whole, or not there: never read half-written


def incidents(config: Path) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "KIMI_SERVE_CONFIG"}
    done = subprocess.run(
        [str(BIN), "incidents", "--json", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert done.returncode == 0, done
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def log_tail(row: dict[str, Any]) -> str:
    return (Path(row["path"]) / "log_tail.txt").read_text()


def test_internal_errors_hand_over_keeping_sglang_at_most_three_times(tmp_path: Path) -> None:
    assert RECOVER_MAX == 3
    fault = tmp_path / "internal-error"
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg, env={injected.ENV: str(fault)}) as d:
        d.wait_state("ready")
        sglang = d.sglang_pid()
        procs = [psutil.Process(p) for p in d.status()["child"]["processes"]]
        daemon_pid = d.proc.pid
        for n, (where, said) in enumerate(
            [
                ("task", "internal task failed; handing over"),
                ("dispatch", "internal error; handing over"),
                ("task", "internal task failed; handing over"),
            ],
            start=1,
        ):
            inject(fault, where)
            e = d.wait_for(lambda e, said=said: e.get("event") == said, 30, said)
            assert "InjectedError" in e["error"] and where in e["error"]
            d.wait_for(lambda e: e.get("event") == "hand-over complete", 30, "hand-over")
            st = d.status()
            assert st["state"] == "ready"
            assert st["child"]["pid"] == sglang  # adopted, not relaunched
            assert d.proc.pid == daemon_pid and d.proc.poll() is None
            assert st["daemon"]["handoffs"] == n
            assert st["daemon"]["last_handoff"]["outcome"] == "ok"
            metrics = d.get("/metrics").text
            assert f'kimi_serve_handoffs_total{{outcome="ok"}} {float(n)}' in metrics
            assert d.get("/readyz").status_code == 200
        assert (tmp_path / "launches").read_text().strip() == "1"
        rows = incidents(d.config_path)
        assert len(rows) == RECOVER_MAX
        assert {r["reason"] for r in rows} == {"internal_error"}
        # SGLang's tail, then the daemon's own traceback.
        tail = log_tail(rows[0])
        assert "--- the daemon's traceback ---" in tail
        assert "Traceback (most recent call last)" in tail
        assert "InjectedError: an internal error injected in the task" in tail
        assert 'injected.check("dispatch")' in log_tail(rows[1])  # the loop's frame

        # The fourth within the hour: the old path, a clean stop of SGLang and exit 1.
        inject(fault, "task")
        why = d.wait_for(
            lambda e: e.get("event") == "internal error not handed over", 30, "refusal"
        )
        assert why["why"] == "3 hand-overs after internal errors within 3600s"
        assert d.proc.wait(60) == 1
        assert not wait_gone(procs, timeout=10), "SGLang outlived the daemon"
        assert any("internal task failed; stopping" in line for line in d.raw)
    rows = incidents(d.config_path)
    assert len(rows) == RECOVER_MAX + 1 and rows[0]["reason"] == "internal_error"
    assert "InjectedError" in log_tail(rows[0])
