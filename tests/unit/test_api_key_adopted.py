"""The key a daemon that adopts SGLang after a hand-over sends: the one that launch was given
(`<state_dir>/sglang-secrets.yaml`), read as hostile input, else the configured one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from supervisor import config
from supervisor.config import Config
from supervisor.sglang import api_key as sglang_key


def keyed(tmp_path: Path, key: str = "sk-configured") -> Config:
    key_file = tmp_path / "sglang.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    text = yaml.safe_dump(
        {
            "sglang": {"model_path": "/m", "api_key_file": str(key_file)},
            "state_dir": str(tmp_path),
        }
    )
    return config.parse(text, "t.yaml")


def test_the_key_the_launch_wrote_is_the_one_sent(tmp_path: Path) -> None:
    cfg = keyed(tmp_path, "sk-rotated-since")
    sglang_key.write_secrets(str(tmp_path), "sk-launched-with")
    assert sglang_key.launched_key(cfg) == ("sk-launched-with", None)


def test_without_a_written_key_the_configured_one_is_sent(tmp_path: Path) -> None:
    cfg = keyed(tmp_path, "sk-configured")
    assert sglang_key.launched_key(cfg) == ("sk-configured", None)


@pytest.mark.parametrize(
    "content",
    [
        b"api-key: [1, 2]\n",
        b"api-key: 'two words'\n",
        b"- not a mapping\n",
        b"api-key: " + b"x" * (sglang_key.MAX_KEY_BYTES + 1) + b"\n",
        b"\xff\xfe not text",
        b"api-key: {unclosed\n",
    ],
)
def test_a_written_file_that_is_not_a_key_falls_back_to_the_configured_one(
    tmp_path: Path, content: bytes
) -> None:
    cfg = keyed(tmp_path, "sk-configured")
    Path(sglang_key.secrets_path(str(tmp_path))).write_bytes(content)
    assert sglang_key.launched_key(cfg) == ("sk-configured", None)


def test_a_link_or_a_fifo_in_its_place_is_not_read(tmp_path: Path) -> None:
    cfg = keyed(tmp_path, "sk-configured")
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text("api-key: sk-planted\n")
    path = Path(sglang_key.secrets_path(str(tmp_path)))
    path.symlink_to(elsewhere)
    assert sglang_key.launched_key(cfg) == ("sk-configured", None)
    path.unlink()
    os.mkfifo(path)  # opened without blocking, then refused as not a regular file
    assert sglang_key.launched_key(cfg) == ("sk-configured", None)


def test_an_unreadable_key_file_is_said_not_raised(tmp_path: Path) -> None:
    cfg = keyed(tmp_path)
    (tmp_path / "sglang.key").chmod(0o644)
    key, problem = sglang_key.launched_key(cfg)
    assert key is None
    assert problem is not None and "sglang.api_key_file" in problem


def test_an_unkeyed_config_sends_no_key(tmp_path: Path) -> None:
    cfg = config.parse(
        yaml.safe_dump({"sglang": {"model_path": "/m"}, "state_dir": str(tmp_path)}), "t.yaml"
    )
    assert sglang_key.launched_key(cfg) == (None, None)
