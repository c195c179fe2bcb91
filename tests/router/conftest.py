"""One real router per test module (a start costs about a second); stand-ins per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.router import RouterProcess, router_available
from testkit.standin import Launcher

if not router_available():
    pytest.skip(
        "sglang-router is not installed (scripts/setup --test installs it)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def router() -> Iterator[RouterProcess]:
    # Pending additions give up after 10 s, so one aimed at a port nothing listens on cannot
    # register a later test's stand-in that happens to get the same port.
    proc = RouterProcess(["--worker-startup-timeout-secs", "10"]).start()
    yield proc
    proc.cleanup()


@pytest.fixture
def launch() -> Iterator[Launcher]:
    with Launcher() as launcher:
        yield launcher
