"""Preflight against SGLang 0.5.23's real argument parser (tools/sglang-env).

These are the incident's failures, caught in seconds instead of after a 10-minute load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor import preflight
from supervisor.config import ConfigError, load
from supervisor.daemon import reload
from supervisor.preflight import EX_CONFIG, Check, run_checks
from supervisor.sglang import options as sglang
from supervisor.sglang.argv import build
from supervisor.sglang.options import run_sglang_parser
from testkit.paths import REPO_ROOT
from testkit.preflight import MakeConfig, model_dir

PROFILES = ("primary", "incident", "bad_parser", "unknown_flag", "deprecated", "abbreviated")


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


@dataclasses.dataclass(frozen=True)
class Run:
    checks: dict[str, Check]
    seconds: float
    imports: int  # processes that imported SGLang to parse

    def __getitem__(self, name: str) -> Check:
        return self.checks[name]


@contextlib.contextmanager
def sglang_imports() -> Iterator[list[int]]:
    """Counts the subprocesses that import SGLang to run its parser (run_sglang_parser's)."""
    seen: list[int] = []
    real_run = subprocess.run

    def run(args: Any, *a: Any, **kw: Any) -> Any:
        if isinstance(args, list) and args[1:2] == [str(sglang.PARSER_PROGRAM)]:
            seen.append(len(json.loads(kw.get("input") or "{}").get("requests", ())))
        return real_run(args, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sglang.subprocess, "run", run)
        yield seen


@pytest.fixture(scope="module")
def many(sglang_python: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One preflight over six profiles: one subprocess, one SGLang import."""
    tmp = tmp_path_factory.mktemp("many")
    text = f"""
sglang:
  python: {sglang_python}
  model_path: {model_dir(tmp / "model")}
  args:
    tp-size: 1
    speculative-algorithm: EAGLE3
    speculative-draft-model-path: {model_dir(tmp / "draft")}
    speculative-num-steps: 3
    speculative-eagle-topk: 1
    speculative-num-draft-tokens: 4
    cuda-graph-max-bs-decode: 128
    reasoning-parser: kimi_k2
  env:
    SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION: "1"
profiles:
  incident:
    args: {{cuda-graph-max-bs-decode: null, cuda-graph-max-bs: 128}}
  bad_parser:
    args: {{reasoning-parser: nope}}
  unknown_flag:
    args: {{frobnicate-the-kv-cache: true}}
  deprecated:
    args: {{enable-flashinfer-allreduce-fusion: true}}
    env: {{SGLANG_ENABLE_SPEC_V2: "1"}}
  abbreviated:
    args: {{disable-overlap: true}}
gpus: {{manage: false}}
"""
    path = tmp / "kimi-serve.yaml"
    path.write_text(text)
    cfg = load(str(path))
    start = time.monotonic()
    with sglang_imports() as imports:
        checks = by_name(run_checks(cfg, profiles=PROFILES))
    seconds = time.monotonic() - start
    print(f"\n[preflight] six profiles through SGLang's parser: {seconds:.1f} s")
    assert imports == [len(PROFILES)], imports
    return Run(checks, seconds, len(imports))


def test_the_whole_run_is_one_sglang_import(many: Run) -> None:
    # Importing torch + SGLang is what costs seconds: every profile is parsed by one process.
    assert many.imports == 1
    assert "SGLang 0.5.23" in many["sglang"].message


def test_a_good_command_line_passes(many: Run) -> None:
    check = many["parser[primary]"]
    assert check.ok and not check.warning, check.render()
    assert many["env[primary]"].ok and not many["env[primary]"].warning


def test_the_incident_flag_is_caught_with_sglangs_message_and_the_rename(
    many: Run,
) -> None:
    check = many["parser[incident]"]
    assert not check.ok and check.kind == "config"
    assert (
        "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, "
        "--cuda-graph-max-bs-prefill" in check.message
    )
    assert "cuda-graph-max-bs-decode: N" in check.hint
    assert "profiles.incident.args.cuda-graph-max-bs" in check.hint


def test_an_invalid_parser_name_is_caught(many: Run) -> None:
    check = many["parser[bad_parser]"]
    assert not check.ok and check.kind == "config"
    assert "argument --reasoning-parser: invalid choice: 'nope'" in check.message
    assert "'kimi_k2'" in check.message  # SGLang lists its choices
    assert "profiles.bad_parser.args.reasoning-parser" in check.hint


def test_an_unknown_flag_is_caught(many: Run) -> None:
    check = many["parser[unknown_flag]"]
    assert not check.ok and check.kind == "config"
    assert "unrecognized arguments: --frobnicate-the-kv-cache" in check.message
    assert "not a flag of this SGLang" in check.hint


def test_deprecated_spellings_pass_with_a_warning(many: Run) -> None:
    check = many["parser[deprecated]"]
    assert check.ok and check.warning, check.render()
    assert "flashinfer-allreduce-fusion-backend: auto" in check.hint
    env = many["env[deprecated]"]
    assert env.ok and env.warning
    assert "SGLANG_ENABLE_SPEC_V2: no longer read" in env.hint


def test_an_abbreviated_flag_is_a_warning(many: Run) -> None:
    check = many["parser[abbreviated]"]
    assert check.ok and check.warning
    assert "--disable-overlap: accepted only as an abbreviation of --disable-overlap-schedule" in (
        check.hint
    )


def test_the_production_config_passes(sglang_python: str) -> None:
    cfg = load(str(REPO_ROOT / "etc" / "kimi-serve.yaml"))
    cfg = dataclasses.replace(cfg, sglang=dataclasses.replace(cfg.sglang, python=sglang_python))
    checks, code = preflight.startup_checks(cfg, gpu_count=lambda: 8)
    named = by_name(checks)
    for name in ("interpreter", "sglang", "parser[primary]", "parser[fallback]"):
        assert named[name].ok and not named[name].warning, named[name].render()
    assert named["env[primary]"].ok and not named["env[primary]"].warning
    # /shared is not mounted on a CI machine: a host problem to wait for, not a config one.
    assert named["model_path"].kind == "host"
    assert code is None
    assert all(c.kind == "host" for c in preflight.failures(checks))


def test_parsing_every_profile_once_is_one_import(sglang_python: str) -> None:
    cfg = load(str(REPO_ROOT / "etc" / "kimi-serve.yaml"))
    argvs = [(list(build(cfg, p).argv[3:]), {}) for p in cfg.profile_names] * 3
    with sglang_imports() as imports:
        report = run_sglang_parser(sglang_python, argvs)
    assert report.failure is None and report.import_error is None
    assert len(report.verdicts) == 6 and all(v.ok for v in report.verdicts)
    assert imports == [6]  # six command lines, one process


def test_run_stops_with_78_on_the_incident_flag(
    sglang_python: str, make_config: MakeConfig
) -> None:
    cfg = make_config(python=sglang_python, args={"cuda-graph-max-bs": 128})
    checks, code = preflight.startup_checks(cfg, gpu_count=None)
    assert code == EX_CONFIG
    assert "ambiguous option: --cuda-graph-max-bs" in preflight.summary(checks)


def test_the_preflight_command_exits_78_and_prints_the_hint(
    sglang_python: str, make_config: MakeConfig
) -> None:
    cfg = make_config(python=sglang_python, args={"cuda-graph-max-bs": 128, "frobnicate": 1})
    proc = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "preflight", "--config", cfg.path],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == EX_CONFIG, proc.stdout + proc.stderr
    out = proc.stdout
    assert "FAIL  parser[primary]" in out
    assert "ambiguous option: --cuda-graph-max-bs could match" in out
    assert "cuda-graph-max-bs-decode: N" in out
    # Every rejected flag in one run, not only the first.
    assert "also rejected: unrecognized arguments: --frobnicate 1" in out
    assert out.rstrip().splitlines()[-1].startswith("config problem")


def test_an_interpreter_without_sglang_is_a_config_problem(make_config: MakeConfig) -> None:
    cfg = make_config(python=sys.executable)  # kimi-serve's own venv has no SGLang
    named = by_name(run_checks(cfg))
    assert not named["sglang"].ok and named["sglang"].kind == "config"
    assert "cannot import sglang.srt.server_args" in named["sglang"].message
    assert "parser[primary]" not in named


def test_sglang_version(sglang_python: str) -> None:
    assert sglang.sglang_version(sglang_python) == "0.5.23"
    assert sglang.sglang_version(sys.executable) is None
    assert sglang.sglang_version("/nonexistent/python") is None


def test_sglang_version_for_config(sglang_python: str, make_config: MakeConfig) -> None:
    assert preflight.sglang_version_for(make_config(python=sglang_python)) == "0.5.23"
    standin = make_config(python=sglang_python, module="supervisor.standin")
    assert preflight.sglang_version_for(standin) is None


def test_a_reload_with_a_rejected_flag_says_all_of_it(
    sglang_python: str, make_config: MakeConfig
) -> None:
    # The refusal is one log line: the hint and the key with its line must not be cut off, as
    # the one-line STATUS= summary is.
    cfg = make_config(python=sglang_python, args={"cuda-graph-max-bs": 128})
    lines = Path(cfg.path).read_text().splitlines()
    line = next(i for i, t in enumerate(lines, 1) if t.strip().startswith("cuda-graph-max-bs:"))
    with pytest.raises(ConfigError) as err:
        reload._read(cfg.path)
    text = err.value.render()
    assert "ambiguous option: --cuda-graph-max-bs" in text
    assert "cuda-graph-max-bs-decode" in text  # the hint
    assert f"(set at sglang.args.cuda-graph-max-bs in {cfg.path}:{line})" in text
