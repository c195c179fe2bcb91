"""Fixtures that start stand-ins and always kill everything they started."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest

from testkit import free_port
from testkit.standin import Standin

MODEL = "/models/kimi-k2.5-int4"


class Launcher:
    def __init__(self) -> None:
        self.started: list[Standin] = []

    def __call__(
        self,
        *flags: str,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        ready: bool = True,
    ) -> Standin:
        port = port or free_port()
        standin = Standin(["--model-path", MODEL, "--port", str(port), *flags], env or {}, port)
        self.started.append(standin)
        if ready:
            standin.wait_ready()
        return standin

    def cleanup(self) -> None:
        for standin in self.started:
            standin.cleanup()


@pytest.fixture
def launch() -> Iterator[Launcher]:
    launcher = Launcher()
    yield launcher
    launcher.cleanup()


@pytest.fixture(scope="module")
def module_launch() -> Iterator[Launcher]:
    launcher = Launcher()
    yield launcher
    launcher.cleanup()
