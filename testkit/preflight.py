"""What the preflight and Kubernetes tests share: SGLang 0.5.23's real environment (its parser),
built by tools/sglang-env on first use (`sglang_python`, a session fixture, with the build's
timeout on the first test that asks for it), and model directories that exist (`model_dir`).

A conftest takes the fixture and the hook by importing them."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.config import Config
from testkit.paths import REPO_ROOT
from testkit.realsglang import BUILD_TIMEOUT


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
