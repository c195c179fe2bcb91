"""Fixtures for the GPU tests: each test gets its own simulation tag, so the simulated NVML sees
only that test's processes, and every process a test starts is killed when it ends."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from supervisor.gpu.sim import ENV_TAG
from testkit.gpu import Procs


@pytest.fixture
def procs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Procs]:
    tag = f"gpu-test-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv(ENV_TAG, tag)
    p = Procs(tag)
    try:
        yield p
    finally:
        p.cleanup()
