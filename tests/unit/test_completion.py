"""Shell completion and the man page: generated from the parser, installed by the .deb, and
naming every command (packaging/completion/, packaging/kimi-serve.1)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from supervisor import completion
from supervisor.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
BASH = ROOT / "packaging" / "completion" / "kimi-serve"
ZSH = ROOT / "packaging" / "completion" / "_kimi-serve"
COMMANDS = [c.name for c in completion.commands(build_parser())]


def test_the_shipped_scripts_are_what_the_parser_generates() -> None:
    parser = build_parser()
    fix = "python -m supervisor.completion bash > packaging/completion/kimi-serve (and zsh)"
    assert BASH.read_text() == completion.bash(parser), fix
    assert ZSH.read_text() == completion.zsh(parser), fix


def test_every_command_is_named_by_both_and_by_the_man_page() -> None:
    assert {"run", "status", "restart", "drain", "undrain", "incidents", "demo"} <= set(COMMANDS)
    man = (ROOT / "packaging" / "kimi-serve.1").read_text()
    for name in COMMANDS:
        assert f" {name}" in BASH.read_text() or f'"{name} ' in BASH.read_text(), name
        assert f"'{name}:" in ZSH.read_text(), name
        assert f".B {name}" in man, f"packaging/kimi-serve.1 does not describe {name}"


def _complete(*words: str) -> list[str]:
    """What bash offers for `kimi-serve WORDS...` (the last word being completed)."""
    line = " ".join(f"'{w}'" for w in words)
    script = (
        f"source {BASH}\nCOMP_WORDS=(kimi-serve {line}); COMP_CWORD={len(words)}\n"
        "_kimi_serve; printf '%s\\n' \"${COMPREPLY[@]}\""
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_bash_completes_commands_options_and_files(tmp_path: Path) -> None:
    assert set(_complete("")) >= set(COMMANDS)
    assert _complete("und") == ["undrain"]
    assert set(_complete("restart", "--")) >= {"--wait", "--timeout", "--json", "--config"}
    assert "--wait" not in _complete("status", "--")  # status follows with --watch
    assert "--watch" in _complete("status", "--")
    assert _complete("canary", "a") == ["accept"]
    (tmp_path / "site.yaml").write_text("")
    assert _complete("status", "--config", str(tmp_path / "si")) == [str(tmp_path / "site.yaml")]


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_reads_its_script() -> None:
    done = subprocess.run(["zsh", "-n", str(ZSH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
