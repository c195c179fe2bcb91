"""supervisor.sglang.argv: config + profile -> the exact SGLang argv and environment."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from supervisor import config
from supervisor.config import Config
from supervisor.sglang import caches
from supervisor.sglang.argv import build, flag_tokens

PRODUCTION = Path(__file__).resolve().parents[2] / "etc" / "kimi-serve.yaml"
SPECULATIVE = (
    "speculative-algorithm",
    "speculative-draft-model-path",
    "speculative-num-steps",
    "speculative-eagle-topk",
    "speculative-num-draft-tokens",
)


def make(
    args: dict[str, Any] | None = None,
    env: dict[str, Any] | None = None,
    profiles: dict[str, Any] | None = None,
    **sglang: Any,
) -> Config:
    """A Config through the real parser, so the tests see what an operator's YAML gives."""
    doc: dict[str, Any] = {
        "sglang": {
            "python": "/venv/bin/python",
            "model_path": "/models/kimi",
            "args": args or {},
            "env": env or {},
            **sglang,
        }
    }
    if profiles is not None:
        doc["profiles"] = profiles
    return config.parse(yaml.safe_dump(doc, sort_keys=False), "test.yaml")


def own(env: Mapping[str, str]) -> dict[str, str]:
    """A launch's environment without the compile caches' variables (caches.py)."""
    return {k: v for k, v in env.items() if k not in {c.env for c in caches.CACHES}}


def flags(argv: tuple[str, ...]) -> list[str]:
    """The argv after `<python> -m <module> --model-path M --host H --port P`."""
    return list(argv[9:])


# --------------------------------------------------------------------------------------------
# One flag
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "tokens"),
    [
        (True, ["--x"]),
        (False, []),
        (None, []),
        (8, ["--x", "8"]),
        (0, ["--x", "0"]),
        (-1, ["--x", "-1"]),
        (0.85, ["--x", "0.85"]),
        (2.0, ["--x", "2.0"]),
        (1e-05, ["--x", "1e-05"]),
        ("EAGLE3", ["--x", "EAGLE3"]),
        ("", ["--x", ""]),
        ("a b 'c'", ["--x", "a b 'c'"]),
        (("1", 2, 4.5), ["--x", "1", "2", "4.5"]),
        ((1,), ["--x", "1"]),
    ],
    ids=repr,
)
def test_flag_tokens(value: Any, tokens: list[str]) -> None:
    assert flag_tokens("x", value) == tokens


# --------------------------------------------------------------------------------------------
# The whole command line
# --------------------------------------------------------------------------------------------


def test_argv_starts_with_interpreter_module_and_the_reserved_flags() -> None:
    spec_cfg = make(host="0.0.0.0", port=31000, module="sglang.launch_server")
    spec = build(spec_cfg)
    assert spec.argv == (
        "/venv/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/kimi",
        "--host",
        "0.0.0.0",
        "--port",
        "31000",
    )
    assert spec.profile == "primary"
    # Only the compile caches, under warm.cache_dir (caches.py).
    assert spec.env == caches.env(spec_cfg.warm.cache_dir)
    assert spec.args == {}


def test_cache_variables_follow_warm_cache_dir_and_lose_to_sglang_env() -> None:
    doc = {
        "sglang": {
            "python": "/venv/bin/python",
            "model_path": "/models/kimi",
            "env": {"TRITON_CACHE_DIR": "/fast/triton"},
        },
        "warm": {"cache_dir": "/var/cache/kimi-serve"},
    }
    env = build(config.parse(yaml.safe_dump(doc), "test.yaml")).env
    assert env["TRITON_CACHE_DIR"] == "/fast/triton"
    assert env["SGLANG_DG_CACHE_DIR"] == "/var/cache/kimi-serve/deep_gemm"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/var/cache/kimi-serve/inductor"
    assert env["FLASHINFER_WORKSPACE_BASE"] == "/var/cache/kimi-serve/flashinfer"
    assert env["CUDA_CACHE_PATH"] == "/var/cache/kimi-serve/nv"
    assert env["TORCH_EXTENSIONS_DIR"] == "/var/cache/kimi-serve/torch_extensions"
    assert caches.paths(env)["triton"] == "/fast/triton"


def test_flag_forms_in_config_order() -> None:
    cfg = make(
        args={
            "tp-size": 8,
            "enable-metrics": True,
            "disable-radix-cache": False,
            "chunked-prefill-size": None,
            "mem-fraction-static": 0.85,
            "cuda-graph-bs": [1, 2, 4],
            "served-model-name": "kimi k2",
        }
    )
    spec = build(cfg)
    assert flags(spec.argv) == [
        "--tp-size",
        "8",
        "--enable-metrics",
        "--mem-fraction-static",
        "0.85",
        "--cuda-graph-bs",
        "1",
        "2",
        "4",
        "--served-model-name",
        "kimi k2",
    ]
    # The flag map the argv came from holds only what reached the argv.
    assert spec.args == {
        "tp-size": 8,
        "enable-metrics": True,
        "mem-fraction-static": 0.85,
        "cuda-graph-bs": (1, 2, 4),
        "served-model-name": "kimi k2",
    }


def test_profile_overrides_in_place_removes_and_appends() -> None:
    cfg = make(
        args={"a": 1, "b": True, "c": "x", "d": 2},
        profiles={"p": {"args": {"c": "y", "b": None, "e": True, "a": False}}},
    )
    assert flags(build(cfg).argv) == ["--a", "1", "--b", "--c", "x", "--d", "2"]
    spec = build(cfg, "p")
    # Base order kept (c overridden in place, a/b removed), the profile's new flag last.
    assert flags(spec.argv) == ["--c", "y", "--d", "2", "--e"]
    assert spec.profile == "p"
    assert spec.args == {"c": "y", "d": 2, "e": True}


def test_profile_leaves_the_base_config_untouched() -> None:
    cfg = make(args={"a": 1}, profiles={"p": {"args": {"a": None}}})
    build(cfg, "p")
    assert flags(build(cfg).argv) == ["--a", "1"]


def test_env_merging() -> None:
    cfg = make(
        env={"KEEP": "1", "DROP": "2", "CHANGE": "old"},
        profiles={"p": {"env": {"DROP": None, "CHANGE": "new", "ADD": "a b"}}},
    )
    assert own(build(cfg).env) == {"KEEP": "1", "DROP": "2", "CHANGE": "old"}
    spec = build(cfg, "p")
    assert own(spec.env) == {"KEEP": "1", "CHANGE": "new", "ADD": "a b"}
    assert config.merged_env(cfg, "p") == own(spec.env)
    assert spec.env_lines() == sorted(
        [
            *(f"{k}={v}" for k, v in caches.env(cfg.warm.cache_dir).items()),
            "ADD='a b'",
            "CHANGE=new",
            "KEEP=1",
        ]
    )


def test_unknown_profile_raises_key_error_naming_the_defined_ones() -> None:
    cfg = make(profiles={"fallback": {"args": {}}})
    with pytest.raises(KeyError, match=r"unknown profile 'nope'; defined: primary, fallback"):
        build(cfg, "nope")


def test_primary_profile_by_name_is_the_base() -> None:
    cfg = make(args={"a": 1}, profiles={"p": {"args": {"a": 2}}})
    assert build(cfg, "primary") == build(cfg)


# --------------------------------------------------------------------------------------------
# LaunchSpec properties
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "speculative"),
    [
        ({"speculative-algorithm": "EAGLE3"}, True),
        ({"speculative-algorithm": "NEXTN"}, True),
        ({"speculative-algorithm": None}, False),
        ({"speculative-algorithm": False}, False),
        ({"speculative-algorithm": "NONE"}, False),
        ({"speculative-num-steps": 3}, False),
        ({}, False),
    ],
    ids=repr,
)
def test_speculative(args: dict[str, Any], speculative: bool) -> None:
    assert build(make(args=args)).speculative is speculative


@pytest.mark.parametrize(
    ("args", "tp"),
    [
        ({"tp-size": 8}, 8),
        ({"tensor-parallel-size": 4}, 4),
        ({"tp-size": "2"}, 2),
        ({}, 1),
        ({"tp-size": None}, 1),
    ],
    ids=repr,
)
def test_tp_size(args: dict[str, Any], tp: int) -> None:
    assert build(make(args=args)).tp_size == tp


def test_production_primary_and_fallback() -> None:
    cfg = config.load(str(PRODUCTION))
    primary, fallback = build(cfg), build(cfg, "fallback")
    assert primary.speculative and not fallback.speculative
    assert primary.tp_size == fallback.tp_size == 8
    for name in SPECULATIVE:
        assert f"--{name}" in primary.argv
        assert f"--{name}" not in fallback.argv
        assert name not in fallback.args
    # Everything else is the same command line.
    rest = [t for t in primary.argv if not t.startswith("--speculative")]
    spec_values = {str(primary.args[n]) for n in SPECULATIVE}
    assert [t for t in rest if t not in spec_values] == list(fallback.argv)
    want = {"SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION": "1", "SPT_NOENV": "1"}
    assert own(primary.env) == own(fallback.env) == want


# --------------------------------------------------------------------------------------------
# Shell quoting
# --------------------------------------------------------------------------------------------


def test_shell_line_quotes_spaces_and_quotes() -> None:
    cfg = make(
        args={"served-model-name": "kimi k2", "chat-template": 'it\'s "quoted"', "x": "$HOME"}
    )
    spec = build(cfg)
    line = spec.shell()
    assert "'kimi k2'" in line
    assert "'$HOME'" in line
    assert shlex.split(line) == list(spec.argv)


_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"))


@given(
    model_path=_text.filter(bool),
    values=st.lists(st.one_of(_text, st.integers(), st.booleans()), max_size=5),
    env_value=_text,
)
def test_shell_round_trips(model_path: str, values: list[Any], env_value: str) -> None:
    cfg = make(
        args={f"flag-{i}": v for i, v in enumerate(values)},
        env={"V": env_value},
        model_path=model_path,
    )
    spec = build(cfg)
    assert shlex.split(spec.shell()) == list(spec.argv)
    assert spec.argv[4] == model_path
    [line] = [x for x in spec.env_lines() if x.startswith("V=")]
    assert shlex.split(line) == [f"V={env_value}"]
