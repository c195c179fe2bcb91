"""Fixtures for the Kubernetes manifest tests: the rendered overlays, SGLang's parser."""

from __future__ import annotations

from typing import Any

import pytest

from testkit.kubernetes import OVERLAYS, render
from testkit.preflight import (  # noqa: F401 (the same session fixture and its timeout)
    pytest_collection_modifyitems,
    sglang_python,
)


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}
