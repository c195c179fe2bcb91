"""supervisor.config.settings: every key declared once, and what is derived from it: the
README's table, the parser's defaults and known keys, the dataclasses' defaults."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor import config
from supervisor.config import settings
from supervisor.config.types import CanaryConfig, GroupConfig, QualityConfig, RouterConfig

REPO = Path(__file__).resolve().parents[2]
MINIMAL = "sglang: {model_path: /m}\n"


def readme_table() -> str:
    lines = (REPO / "README.md").read_text().split("\n")
    start = lines.index(settings.TABLE_HEADER.split("\n")[0])
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end])


def test_readme_config_table_is_the_generated_one() -> None:
    assert readme_table() == settings.markdown(), (
        "README.md's configuration table differs from the declarations: regenerate it with "
        "`python -m supervisor.config.settings --markdown`"
    )


def test_markdown_command_prints_the_table() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.config.settings", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert done.stdout == settings.markdown() + "\n"
    bad = subprocess.run(
        [sys.executable, "-m", "supervisor.config.settings"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_each_key_is_declared_once_with_a_doc() -> None:
    keys = [s.key for s in settings.SETTINGS]
    assert len(keys) == len(set(keys))
    for s in settings.SETTINGS:
        assert s.doc.strip() and "|" not in s.doc, s.key
        assert s.shown_default().strip(), s.key


def _attr(cfg: object, key: str) -> Any:
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


# Where the typed field is not the key's value itself.
_OTHER_FIELD = {"admin.listen": lambda c: (c.admin.host, c.admin.port)}


@pytest.mark.parametrize(
    "s",
    [s for s in settings.SETTINGS if s.conv and s.value is not None and not s.required],
    ids=lambda s: s.key,
)
def test_the_parser_defaults_are_the_declared_ones(s: settings.Setting) -> None:
    cfg = config.parse(MINIMAL, "f.yaml")
    got = _OTHER_FIELD[s.key](cfg) if s.key in _OTHER_FIELD else _attr(cfg, s.key)
    assert got == s.value


def test_dataclass_defaults_follow_the_table() -> None:
    cfg = config.parse(MINIMAL, "f.yaml")
    assert cfg.quality == QualityConfig()
    assert cfg.quality.canary == CanaryConfig()
    assert dataclasses.replace(cfg.router, worker_url="") == RouterConfig()
    assert cfg.group == GroupConfig(token_file=cfg.admin.token_file)


def test_known_keys_come_from_the_table() -> None:
    assert settings.known("") == config.TOP_KEYS
    assert settings.known("restart") == (
        "backoff_initial",
        "backoff_max",
        "crash_loop",
        "fallback_profile",
        "stable_after",
        "mode",
    )
    with pytest.raises(config.ConfigError) as info:
        config.parse(MINIMAL + "liveness: {intervall: 3s}\n", "f.yaml")
    (issue,) = info.value.issues
    assert issue.message == (
        "unknown key 'intervall'; did you mean 'interval'? "
        f"(known: {', '.join(settings.known('liveness'))})"
    )


def _leaf_keys(raw: object, path: str = "") -> list[str]:
    if not isinstance(raw, dict):
        return [path]
    if path in ("sglang.args", "sglang.env") or (
        path.startswith("profiles.") and path.count(".") == 2
    ):
        return [path]
    out = []
    for key, value in raw.items():
        out.extend(_leaf_keys(value, f"{path}.{key}" if path else key))
    return out


def test_every_key_of_the_shipped_config_is_declared() -> None:
    raw = yaml.safe_load((REPO / "etc" / "kimi-serve.yaml").read_text())
    declared = {s.key.replace("NAME", "*") for s in settings.SETTINGS}
    for key in _leaf_keys(raw):
        if key.startswith("profiles."):
            name = key.split(".")[1]
            key = key.replace(f"profiles.{name}", "profiles.*")
        assert key in declared, key
