"""Two servers, one suite: the SGLang stand-in and real SGLang 0.5.23 on this CPU.

Every test in tests/conformance takes a `side` ("standin" or "real") and asks both the same
thing; what kimi-serve reads must agree. Servers cost: a real one takes 20-55 s to start on
two cores, so the read-only tests share one server per side for the whole module
(`server`), and only the tests that end a server start their own (`launch`).

A fault is named once for both sides (`scheduler-exception`): the stand-in's
STANDIN_FAULT=seed-incident, or real SGLang's scheduler made to raise by the test-only hook
(tests/realsglang/faulthook/sitecustomize.py, KIMI_TEST_FAULT=decode-attributeerror).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from testkit import realsglang as real
from testkit.conformance import (
    SIDES,
    Launch,
    Server,
    start,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "side" in getattr(item, "fixturenames", ()):
            # The first real test may pay for building the environment.
            item.add_marker(pytest.mark.timeout(real.BUILD_TIMEOUT + 600))


@pytest.fixture(scope="session")
def sgl() -> real.SGLangEnv:
    return real.build_env()


@pytest.fixture(scope="module", params=SIDES)
def side(request: pytest.FixtureRequest) -> str:
    param: str = request.param
    return param


@pytest.fixture(scope="module")
def server(
    side: str, sgl: real.SGLangEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """An idle server of `side`, shared by the module's read-only tests."""
    s = start(side, sgl, tmp_path_factory.mktemp(f"{side}-shared") / "server.log")
    print(f"[{side}] started in {s.started_in:.1f} s")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def launch(side: str, sgl: real.SGLangEnv, tmp_path: Path) -> Iterator[Launch]:
    """Start a server of `side` that the test may end; whatever is left is killed."""
    started: list[Server] = []

    def make(*, fault: str | None = None, env: Mapping[str, str] | None = None) -> Server:
        s = start(side, sgl, tmp_path / f"server{len(started)}.log", fault=fault, env=env)
        print(f"[{side}] started in {s.started_in:.1f} s")
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
