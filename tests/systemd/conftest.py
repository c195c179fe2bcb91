"""Fixtures for the tests that boot a real systemd (see box.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.box import Box, start_or_skip


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    """A booted box, killed after the test; the test fails if /tmp or /dev changed.

    Skips, saying why, where a box cannot boot (not root, no unshare, no cgroup2).
    """
    booted = Box(tmp_path / "box")
    start_or_skip(booted)
    try:
        yield booted
    finally:
        booted.stop()
    changes = booted.host_changes()
    assert not changes, f"the box changed the host: {changes}"
