"""Under systemd (stdout is the journal) every line starts with its sd-daemon priority, so
`journalctl -p err -u kimi-serve` shows exactly the error events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from testkit import BIN, base_config, kill_owned

pytestmark = pytest.mark.timeout(60)


def test_error_events_carry_priority_3(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path,
        sglang={"env": {"STANDIN_FAULT": "seed-incident", "STANDIN_FAULT_LAUNCH": "1"}},
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    read_fd, write_fd = os.pipe()
    st = os.fstat(write_fd)
    # What systemd sets when it connects stdout to the journal: device and inode of the stream.
    env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    proc = subprocess.Popen(
        [str(BIN), "run", "--config", str(path)], stdout=write_fd, stderr=write_fd, env=env
    )
    os.close(write_fd)
    lines: list[str] = []
    try:
        with os.fdopen(read_fd, "r") as stream:
            for line in stream:
                lines.append(line.rstrip("\n"))
                if '"new": "ready"' in line:
                    break
    finally:
        proc.terminate()
        proc.wait(20)
        kill_owned(str((tmp_path / "state").resolve()))
    by_prio: dict[int, list[dict[str, object]]] = {}
    for line in lines:
        assert line.startswith("<") and line[2] == ">", f"no priority prefix: {line!r}"
        by_prio.setdefault(int(line[1]), []).append(json.loads(line[3:]))
    errors = by_prio.get(3, [])
    assert any(e["event"] == "sglang restart" for e in errors), errors
    # The traceback's lines from SGLang are errors too; the routine lines are not.
    assert any("AttributeError" in str(e["event"]) for e in errors)
    assert all(e["level"] == "error" for e in errors)
    infos = by_prio.get(6, [])
    assert any(e["event"] == "state" and e.get("new") == "ready" for e in infos)
    assert all(e["level"] == "info" for e in infos)


def test_no_prefix_outside_the_journal() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from supervisor import log; log.setup('json','info'); "
            "log.get().error('boom')",
        ],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"},
        timeout=30,
    )
    assert out.stdout.startswith("{") and json.loads(out.stdout)["level"] == "error"
