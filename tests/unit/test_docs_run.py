"""The docs' commands run as written: README's fault list is the stand-in's, and what README
says runs after `scripts/demo`'s setup (no test tools: no pytest) does. The runbook's jq lines
against a real /status: tests/integration/test_runbook_jq.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from supervisor.standin.faults import FAULTS, SEED_INCIDENT

ROOT = Path(__file__).resolve().parents[2]
# Python as scripts/demo's .venv has it: pytest cannot be imported.
WITHOUT_PYTEST = "import sys, runpy; sys.modules['pytest'] = None; sys.argv[1:] = {args!r}; "


def test_the_readmes_fault_list_is_the_stand_ins() -> None:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"Other faults:\s*(.*?)\s*\(see", readme, re.S)
    assert match, "README.md lost its 'Other faults: ... (see' sentence"
    listed = re.findall(r"`([a-z0-9-]+)`", match.group(1))
    assert listed == [f for f in FAULTS if f != SEED_INCIDENT], (
        "README.md's fault list differs from supervisor/standin/faults.py FAULTS"
    )


def _without_pytest(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    code = (
        WITHOUT_PYTEST.format(args=list(args))
        + f"runpy.run_module({module!r}, run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_bench_help_runs_without_the_test_tools() -> None:
    done = _without_pytest("bench", "--help")
    assert done.returncode == 0, done.stderr
    assert "profile-pump" in done.stdout and "Traceback" not in done.stderr


def test_the_reliability_report_says_which_setup_it_needs() -> None:
    done = _without_pytest("tests.reliability.report")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "needs the test tools: run scripts/setup --test first" in done.stderr
