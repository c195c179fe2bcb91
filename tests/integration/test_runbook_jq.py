"""Every `kimi-serve status --json | jq ...` line of docs/runbook.md, run as written against a
real /status document: the daemon with the stand-in, after a restart nobody asked for (so
`last_restart`, its log tail and incident, and the downtime are all there)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from testkit import base_config, running

pytestmark = pytest.mark.timeout(90)

RUNBOOK = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"
JQ_LINE = re.compile(r"status --json \| jq (-r )?(?:'([^']*)'|([^\s`']+))")


def runbook_filters() -> list[tuple[bool, str]]:
    found = [(bool(m[1]), m[2] or m[3]) for m in JQ_LINE.finditer(RUNBOOK.read_text())]
    return list(dict.fromkeys(found))


def top_level_keys(jq_filter: str) -> list[str]:
    """The keys of /status a filter reads at its top (`.a, .b.c`, `.gpus[] | ...` → a, b, gpus)."""
    head = jq_filter.split("|", 1)[0]
    return re.findall(r"(?:^|,)\s*\.([a-z_]+)", head)


def test_the_runbook_has_jq_lines() -> None:
    filters = runbook_filters()
    assert len(filters) >= 10, filters
    assert (True, ".last_restart.log_tail[]") in filters


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed")
def test_each_runbook_jq_line_runs_on_a_real_status(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path)) as d:
        d.wait_state("ready")
        os.kill(d.sglang_pid(), signal.SIGKILL)
        d.wait_state("restarting")
        d.wait_state("ready")
        doc: dict[str, Any] = d.status()
        assert d.stop() == 0
    assert doc["last_restart"]["log_tail"], "the restart left no log tail to read"
    text = json.dumps(doc)
    for raw, jq_filter in runbook_filters():
        for key in top_level_keys(jq_filter):
            assert key in doc, f"runbook: jq {jq_filter!r} reads .{key}, which /status lacks"
        done = subprocess.run(
            ["jq", *(["-r"] if raw else []), jq_filter],
            input=text,
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert done.returncode == 0, (jq_filter, done.stderr)
        if raw:
            # -r is there to print text: a JSON array or object printed instead means the
            # filter stops one step short (the log tail needs `[]`).
            assert done.stdout.strip(), jq_filter
            assert not isinstance(_json_or_none(done.stdout), list | dict), (
                f"jq -r {jq_filter!r} prints JSON, not text: {done.stdout[:200]!r}"
            )


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
