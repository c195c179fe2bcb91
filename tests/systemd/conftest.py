"""Fixtures for the tests that boot a real systemd (see box.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.box import Box, BoxUnavailable


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    """A booted box, killed after the test; the test fails if /tmp or /dev changed.

    Skips, saying why, where a box cannot boot (not root, no unshare, no cgroup2).
    """
    booted = Box(tmp_path / "box")
    try:
        booted.start()
    except BoxUnavailable as why:
        pytest.skip(f"no systemd box on this host: {why}")
    try:
        yield booted
    finally:
        booted.stop()
    changes = booted.host_changes()
    assert not changes, f"the box changed the host: {changes}"
