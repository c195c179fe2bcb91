"""SGLang's own exit status reaches /status.last_restart and the incident.

SGLang ends its workers before it exits (`kill_process_tree`, sglang/srt/utils/common.py), so a
worker's death is often seen first; its status may already be reaped. The restart must still
say how SGLang ended: the main process's exit code or signal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit import base_config, running

pytestmark = pytest.mark.timeout(60)


def test_exit_code_of_sglang_is_reported(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path,
        sglang={
            "env": {
                "STANDIN_FAULT": "exit-after",
                "STANDIN_EXIT_AFTER": "0.5",
                "STANDIN_EXIT_CODE": "3",
                "STANDIN_FAULT_LAUNCH": "1",
            }
        },
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        d.wait_for(
            lambda e: e.get("event") == "state" and e.get("reason") == "exited",
            what="the exit",
        )
        d.wait_state("ready")
        last = d.status()["last_restart"]
        assert last["reason"] == "exited"
        assert (last["exit_code"], last["signal"]) == (3, None), last.get("detail")
        incident = json.loads((Path(last["incident"]) / "incident.json").read_text())
        assert (incident["exit_code"], incident["signal"]) == (3, None)
        assert d.stop() == 0
