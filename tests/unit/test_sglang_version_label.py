"""What the daemon takes from /server_info's `version` for kimi_serve_build_info and /status:
a short version string, never an arbitrary text from a peer as a label value."""

from __future__ import annotations

import pytest

from supervisor.daemon.observed import VERSION_TEXT


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23-standin", "0.6.0rc1+cu128", "1.0.0.dev3"])
def test_a_version_is_taken(version: str) -> None:
    assert VERSION_TEXT.fullmatch(version)


@pytest.mark.parametrize(
    "version", ["", "0.5.23\nkimi_serve_ready 1", 'a"b', "x" * 65, "-rc", "0.5 .23", "\u00e9"]
)
def test_anything_else_is_not(version: str) -> None:
    assert not VERSION_TEXT.fullmatch(version)
