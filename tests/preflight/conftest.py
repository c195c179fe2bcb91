"""Fixtures for preflight: the CPU-only SGLang environment and small configs around it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor.config import Config, parse
from testkit import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT = 1200.0  # a fresh machine installs ~6 GB; a built environment returns at once


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The first test that asks for the environment may pay for building it.
    for item in items:
        if "sglang_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT + 60))


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The interpreter of the SGLang 0.5.23 environment (tools/sglang-env), built if needed."""
    if os.environ.get("KIMI_SERVE_SKIP_SGLANG_ENV") == "1":
        pytest.skip(
            "KIMI_SERVE_SKIP_SGLANG_ENV=1: SGLang's real parser is not available "
            "(tools/sglang-env builds it; CI always does)"
        )
    proc = subprocess.run(
        [str(REPO_ROOT / "tools" / "sglang-env")],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"tools/sglang-env failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


def model_dir(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return str(path)


MakeConfig = Callable[..., Config]


@pytest.fixture
def make_config(tmp_path: Path) -> MakeConfig:
    """A config whose model paths exist and whose port is free; keyword arguments replace
    `sglang` keys (`args` / `env` are merged), `profiles=` and `top=` add sections."""

    def make(
        *,
        profiles: dict[str, Any] | None = None,
        top: dict[str, Any] | None = None,
        **sglang: Any,
    ) -> Config:
        base: dict[str, Any] = {
            "python": "/nonexistent/python",
            "module": "sglang.launch_server",
            "model_path": model_dir(tmp_path / "model"),
            "host": "127.0.0.1",
            "port": free_port(),
            "args": {"tp-size": 1},
            "env": {},
        }
        base["args"] = {**base["args"], **sglang.pop("args", {})}
        base["env"] = {**base["env"], **sglang.pop("env", {})}
        base.update(sglang)
        doc: dict[str, Any] = {"sglang": base, "gpus": {"manage": False}, **(top or {})}
        if profiles:
            doc["profiles"] = profiles
        path = tmp_path / "kimi-serve.yaml"
        text = yaml.safe_dump(doc, sort_keys=False)
        path.write_text(text)
        return parse(text, str(path))

    return make
