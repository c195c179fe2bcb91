"""Fixtures that start stand-ins and always kill everything they started."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.standin import Launcher


@pytest.fixture
def launch() -> Iterator[Launcher]:
    with Launcher() as launcher:
        yield launcher


@pytest.fixture(scope="module")
def module_launch() -> Iterator[Launcher]:
    with Launcher() as launcher:
        yield launcher
