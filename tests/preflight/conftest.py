"""Fixtures for preflight: the CPU-only SGLang environment and small configs around it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor.config import Config, parse
from testkit import free_port
from testkit.preflight import (  # noqa: F401 (the session fixture and its timeout hook)
    MakeConfig,
    model_dir,
    pytest_collection_modifyitems,
    sglang_python,
)


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
