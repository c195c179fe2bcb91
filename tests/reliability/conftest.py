"""Writes the suite's per-trial results where report.py can turn them into the table of
docs/reliability.md: set KIMI_SERVE_RELIABILITY_REPORT=FILE (report.py does it for you)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from testkit.reliability import RESULTS

REPORT_ENV = "KIMI_SERVE_RELIABILITY_REPORT"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(REPORT_ENV)
    if path and RESULTS:
        Path(path).write_text(json.dumps(RESULTS, indent=1))
