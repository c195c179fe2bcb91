"""`journalctl -p err` lists failures only: a restart somebody asked for is logged at info without
SGLang's last lines, one nobody asked for at error with them (the real daemon, the stand-in)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from testkit import base_config, running

pytestmark = pytest.mark.timeout(90)


def _restart_event(e: dict[str, object]) -> bool:
    return e.get("event") == "sglang restart"


def test_a_requested_restart_is_info_a_crash_is_error(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path)) as d:
        d.wait_state("ready")
        assert d.post("/restart").status_code == 202
        asked = d.wait_for(_restart_event, what="the manual restart's record")
        assert (asked["reason"], asked["level"]) == ("manual", "info")
        assert "log_tail" not in asked
        d.wait_state("ready")
        os.kill(d.sglang_pid(), signal.SIGKILL)
        crash = d.wait_for(_restart_event, what="the crash's record")
        assert (crash["reason"], crash["level"]) == ("exited", "error")
        assert crash["log_tail"], crash
        d.wait_state("ready")
        errors = [e for e in d.seen if e.get("level") == "error"]
        assert [e["event"] for e in errors] == ["sglang restart"], errors


def _access(e: dict[str, object], path: str) -> bool:
    return e.get("source") == "sglang" and f'"{path} HTTP/1.1"' in str(e.get("event"))


def test_the_daemons_probe_lines_are_debug_a_users_request_info(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, logging={"level": "debug"})
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        # Liveness probes every 0.5 s: their access lines come at debug.
        d.wait_for(
            lambda e: _access(e, "POST /generate") and e.get("level") == "debug",
            what="a probe's access line at debug",
        )
        sglang = f"http://127.0.0.1:{cfg['sglang']['port']}"
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(sglang + "/generate", json=body, timeout=10).status_code == 200
        user = d.wait_for(
            lambda e: _access(e, "POST /generate") and e.get("level") == "info",
            what="the user's access line at info",
        )
        ours = [e for e in d.seen if _access(e, "POST /generate") and e.get("level") == "debug"]
        assert ours and all(
            e["event"].split(" - ")[0] != user["event"].split(" - ")[0] for e in ours
        )
