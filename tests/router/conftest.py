"""One real router per test module (a start costs about a second); stand-ins per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testkit.router import SMG, SMG_FLEET_FLAGS, RouterProcess, router_available
from testkit.standin import Launcher

if not router_available():
    pytest.skip(
        "sglang-router is not installed (scripts/setup --test installs it)",
        allow_module_level=True,
    )

# Pending additions give up after 10 s, so one aimed at a port nothing listens on cannot
# register a later test's stand-in that happens to get the same port.
STARTUP_TIMEOUT = ["--worker-startup-timeout-secs", "10"]


@pytest.fixture(scope="module")
def router() -> Iterator[RouterProcess]:
    """sglang-router 0.3.2."""
    proc = RouterProcess(STARTUP_TIMEOUT).start()
    yield proc
    proc.cleanup()


@pytest.fixture(scope="module")
def smg_router() -> Iterator[RouterProcess]:
    """SMG 1.13 with the flags docs/fleet.md chooses for a kimi-serve fleet."""
    if not router_available(SMG):
        pytest.skip("smg is not installed (scripts/setup --test installs it)")
    proc = RouterProcess([*SMG_FLEET_FLAGS, *STARTUP_TIMEOUT], kind=SMG).start()
    yield proc
    proc.cleanup()


@pytest.fixture
def launch() -> Iterator[Launcher]:
    with Launcher() as launcher:
        yield launcher
