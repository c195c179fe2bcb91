"""Preflight's own checks on real files, sockets and interpreters (no SGLang needed)."""

from __future__ import annotations

import io
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor import preflight
from supervisor.preflight import (
    GpuCountUnavailable,
    check_gpus,
    check_interpreter,
    check_model_path,
    check_port,
    run_checks,
)
from supervisor.sglang.argv import build
from testkit.preflight import MakeConfig
from testkit.wait import free_port


@pytest.fixture
def listener() -> Iterator[int]:
    """A port held by a listening socket of this process."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_free_port_passes() -> None:
    port = free_port()
    result = check_port("127.0.0.1", port)
    assert result.ok and result.message == f"127.0.0.1:{port} is free"


def test_a_busy_port_is_a_host_problem_that_names_the_holder(listener: int) -> None:
    result = check_port("127.0.0.1", listener)
    assert not result.ok and result.kind == "host"
    assert f"127.0.0.1:{listener} is in use" in result.message
    assert f"(held by pid {os.getpid()}" in result.message
    assert "gpu-clean" in result.hint


def test_a_wildcard_listener_blocks_loopback_too(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        result = check_port("127.0.0.1", s.getsockname()[1])
    assert not result.ok


def test_a_foreign_address_and_an_unresolvable_host_are_host_problems() -> None:
    foreign = check_port("192.0.2.7", free_port())  # TEST-NET-1: never on this machine
    assert (
        not foreign.ok
        and foreign.kind == "host"
        and "not an address of this host" in (foreign.message)
    )
    nowhere = check_port("no-such-host.invalid", free_port())
    assert not nowhere.ok and nowhere.kind == "host" and "cannot resolve" in nowhere.message


def test_a_model_directory_with_config_json_passes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert check_model_path("model_path", str(tmp_path), "sglang.model_path").ok


@pytest.mark.parametrize(
    ("layout", "kind", "words"),
    [
        ("missing", "host", "does not exist"),
        ("empty", "host", "is empty"),
        ("no-config", "config", "has no config.json"),
        ("file", "config", "is a file"),
    ],
)
def test_model_path_problems(tmp_path: Path, layout: str, kind: str, words: str) -> None:
    path = tmp_path / "model"
    if layout == "empty":
        path.mkdir()
    elif layout == "no-config":
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"")
    elif layout == "file":
        path.write_text("{}")
    result = check_model_path("model_path", str(path), "sglang.model_path")
    assert not result.ok and result.kind == kind and words in result.message


def test_a_relative_model_path_is_read_from_the_workdir(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert check_model_path("model_path", "m", "sglang.model_path", str(tmp_path)).ok


def test_a_hub_repo_id_is_not_a_local_path() -> None:
    result = check_model_path("model_path", "moonshotai/Kimi-K2.5", "sglang.model_path")
    assert result.ok and result.skipped


def test_interpreter_checks(tmp_path: Path) -> None:
    assert check_interpreter(sys.executable).ok
    assert check_interpreter("python3").ok  # found on PATH
    missing = check_interpreter(str(tmp_path / "python"))
    assert not missing.ok and missing.kind == "config" and "does not exist" in missing.message
    broken = tmp_path / "broken"
    broken.symlink_to(tmp_path / "gone")
    result = check_interpreter(str(broken))
    assert not result.ok and "broken link" in result.message
    plain = tmp_path / "plain"
    plain.write_text("")
    assert "not an executable" in check_interpreter(str(plain)).message
    assert "not on PATH" in check_interpreter("no-such-python-3.99").message


def test_gpu_checks(make_config: MakeConfig) -> None:
    cfg = make_config(args={"tp-size": 8}, top={"gpus": {"manage": True}})
    specs = [build(cfg)]
    assert check_gpus(cfg, specs, lambda: 8).ok
    few = check_gpus(cfg, specs, lambda: 7)
    assert not few.ok and few.kind == "host" and "7 GPU(s) visible" in few.message

    def nvml_down() -> int:
        raise RuntimeError("NVML: driver not loaded")

    down = check_gpus(cfg, specs, nvml_down)
    assert not down.ok and "driver not loaded" in down.message
    assert check_gpus(cfg, specs, None).skipped

    def cannot() -> int:
        raise GpuCountUnavailable("no NVML layer")

    assert check_gpus(cfg, specs, cannot).skipped
    unmanaged = make_config(args={"tp-size": 8})
    assert check_gpus(unmanaged, specs, lambda: 0).skipped


def test_pipeline_and_nodes_change_the_gpu_count(make_config: MakeConfig) -> None:
    cfg = make_config(args={"tp-size": 8, "pp-size": 2, "nnodes": 2})
    assert preflight.gpus_needed(build(cfg)) == 8


def test_a_non_sglang_module_skips_the_parser_and_starts_nothing(
    make_config: MakeConfig, listener: int
) -> None:
    cfg = make_config(python=sys.executable, module="supervisor.standin", port=listener)
    named = {c.name: c for c in run_checks(cfg)}
    assert named["sglang"].skipped and named["parser"].skipped
    assert "module supervisor.standin is not SGLang" in named["parser"].message
    assert not named["port"].ok
    _, code = preflight.startup_checks(cfg, gpu_count=None)
    assert code is None  # a busy port is retried, not fatal


def test_the_draft_model_comes_from_the_profile_that_sets_it(
    make_config: MakeConfig, tmp_path: Path
) -> None:
    cfg = make_config(
        python=sys.executable,
        module="supervisor.standin",
        args={"speculative-algorithm": "EAGLE3"},
        profiles={"fallback": {"args": {"speculative-draft-model-path": str(tmp_path / "d")}}},
        top={"restart": {"fallback_profile": "fallback"}},
    )
    draft = {c.name: c for c in run_checks(cfg)}["draft_model_path"]
    assert not draft.ok
    assert "profiles.fallback.args.speculative-draft-model-path" in draft.message


def test_a_missing_interpreter_stops_with_78(make_config: MakeConfig) -> None:
    cfg = make_config(python="/nonexistent/python")
    checks, code = preflight.startup_checks(cfg, gpu_count=None)
    assert code == preflight.EX_CONFIG
    assert [c.name for c in preflight.failures(checks)] == ["interpreter"]


def test_the_command_prints_every_check(make_config: MakeConfig) -> None:
    cfg = make_config(python=sys.executable, module="supervisor.standin")
    out = io.StringIO()
    code = preflight.run_preflight_command(cfg, out, gpu_count=lambda: 1)
    text = out.getvalue()
    assert code == 0, text
    assert text.splitlines()[0] == f"kimi-serve preflight: {cfg.path} (profiles: primary)"
    assert "ok    interpreter" in text and "skip  parser" in text and "ok    port" in text
    assert text.rstrip().splitlines()[-1].startswith("ok: the launch can go ahead")


def fake_python(tmp_path: Path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_a_hung_import_is_a_host_problem(tmp_path: Path, make_config: MakeConfig) -> None:
    cfg = make_config(python=fake_python(tmp_path, "exec sleep 30"))
    named = {c.name: c for c in run_checks(cfg, parser_timeout=0.5)}
    assert not named["sglang"].ok and named["sglang"].kind == "host"
    assert "longer than 0.5 s" in named["sglang"].message


def test_a_crashing_interpreter_is_a_config_problem(
    tmp_path: Path, make_config: MakeConfig
) -> None:
    cfg = make_config(python=fake_python(tmp_path, "echo 'Illegal instruction' >&2; exit 132"))
    named = {c.name: c for c in run_checks(cfg)}
    assert not named["sglang"].ok and named["sglang"].kind == "config"
    assert "exited with status 132: Illegal instruction" in named["sglang"].message
