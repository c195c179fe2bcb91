"""Fixtures for the observability tests: promtool, the rules and the dashboard."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.observability import (
    DASHBOARD_FILE,
    GET_PROMTOOL,
    REPO_ROOT,
    RULES_FILE,
)


@pytest.fixture(scope="session")
def promtool() -> Path:
    """Path to promtool, fetched once per session by tools/get-promtool.

    No skip: these tests exist to catch broken rules, and a skipped check is a
    check nobody notices is missing. Without promtool they fail, saying why.
    """
    try:
        done = subprocess.run(
            [str(GET_PROMTOOL)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{GET_PROMTOOL} did not finish in 600 s")
    if done.returncode != 0:
        pytest.fail(
            f"{GET_PROMTOOL} failed (exit {done.returncode}); promtool is required.\n"
            f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
        )
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.is_file(), f"{GET_PROMTOOL} printed {path}, which is not a file"
    return path


@pytest.fixture(scope="session")
def rules() -> dict[str, Any]:
    with RULES_FILE.open() as f:
        data: dict[str, Any] = yaml.safe_load(f)
    return data


@pytest.fixture(scope="session")
def alert_rules(rules: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    with DASHBOARD_FILE.open() as f:
        data: dict[str, Any] = json.load(f)
    return data
