"""Preflight: catch a launch that cannot work in seconds, not ten minutes into a model load.

SGLang renames flags between releases. With 0.5.23 the seed incident's `--cuda-graph-max-bs 128`
is an "ambiguous option" (it prefixes both `--cuda-graph-max-bs-decode` and `-prefill`), and
SGLang says so only after its Python start-up; a port held by a leftover process fails the launch
only after the whole model has loaded (docs/sglang.md). So before any GPU is touched:

- the configured interpreter exists, imports SGLang, and its version is read;
- the exact argv the daemon will launch, for the active profile and the fallback, is parsed by
  the installed SGLang's own parser (`ServerArgs.add_cli_args` in one subprocess of that
  interpreter, `CUDA_VISIBLE_DEVICES=` and no resolution step, so no GPU and no model config);
  a rejection carries SGLang's message and a hint from a table of known renames;
- model and draft model paths exist and hold a `config.json`; enough GPUs; the port is free.

Each check has a kind. `config`: a restart cannot fix it (exit 78, which the unit lists in
RestartPreventExitStatus=, so systemd does not restart-loop on it). `host`: it may clear by
itself (a port still held, an NFS mount not up yet, a GPU the driver has not released), so the
daemon retries with backoff. docs/preflight.md explains every check and what to do.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from supervisor.config import PRIMARY, Config
from supervisor.exits import EX_CONFIG, EXIT_HOST
from supervisor.preflight import serving
from supervisor.preflight.host import GpuCountUnavailable as GpuCountUnavailable
from supervisor.preflight.host import check_caches as check_caches
from supervisor.preflight.host import check_gpus as check_gpus
from supervisor.preflight.host import check_interpreter as check_interpreter
from supervisor.preflight.host import check_model_path as check_model_path
from supervisor.preflight.host import check_port as check_port
from supervisor.preflight.host import gpus_needed as gpus_needed
from supervisor.preflight.result import CONFIG as CONFIG
from supervisor.preflight.result import HOST as HOST
from supervisor.preflight.result import Check as Check
from supervisor.preflight.result import CheckKind as CheckKind
from supervisor.preflight.result import exit_code as exit_code
from supervisor.preflight.result import failures as failures
from supervisor.preflight.result import summary as summary
from supervisor.sglang.argv import LaunchSpec, build
from supervisor.sglang.options import (
    KNOWN_ENV,
    PARSER_TIMEOUT,
    EnvFinding,
    ParserReport,
    Verdict,
    abbreviations,
    error_flags,
    flag_values,
    is_sglang_module,
    known_changes,
    rejection_hint,
    run_sglang_parser,
    sglang_variables,
    sglang_version,
)

# --------------------------------------------------------------------------------------------
# The checks (those of the host alone: supervisor/preflight/host.py)
# --------------------------------------------------------------------------------------------


def default_profiles(cfg: Config) -> tuple[str, ...]:
    """The profiles a run may launch: primary, and the fallback it switches to."""
    fallback = cfg.restart.fallback_profile
    return (PRIMARY,) if fallback in (None, PRIMARY) else (PRIMARY, fallback)


def sglang_version_for(cfg: Config) -> str | None:
    """The version for `kimi_serve_build_info{sglang_version}`: None when the configured module
    is not SGLang (the stand-in) or SGLang is not installed for the interpreter."""
    if not is_sglang_module(cfg.sglang.module):
        return None
    return sglang_version(cfg.sglang.python)


def _where(cfg: Config, profile: str, flag: str) -> str:
    """The config key a flag of the launched argv comes from."""
    top = {"model-path": "sglang.model_path", "host": "sglang.host", "port": "sglang.port"}
    if flag in top:
        return top[flag]
    if profile != PRIMARY and flag in cfg.profile(profile).args:
        return f"profiles.{profile}.args.{flag}"
    return f"sglang.args.{flag}"


def _at(cfg: Config, key: str) -> str:
    """`key in file:line`, as a config error names a key (the line where the file has one)."""
    line = cfg.key_lines.get(key)
    return f"{key} in {cfg.path}:{line}" if line else f"{key} in {cfg.path}"


def _parser_checks(cfg: Config, specs: Sequence[LaunchSpec], report: ParserReport) -> list[Check]:
    python = cfg.sglang.python
    if report.failure is not None:
        # A timeout may be a hung mount; anything else (a crash on import) is the environment.
        kind: CheckKind = HOST if report.timed_out else CONFIG
        return [
            Check(
                "sglang",
                False,
                kind,
                report.failure,
                f"run `{python} -c 'import sglang.srt.server_args'` to see it fail",
            )
        ]
    if report.import_error is not None:
        return [
            Check(
                "sglang",
                False,
                CONFIG,
                f"{python} cannot import sglang.srt.server_args: {report.import_error}",
                "install SGLang into that interpreter's environment, or point sglang.python at "
                "the one it is installed in",
            )
        ]
    version = report.version or "(unknown version)"
    checks = [
        Check(
            "sglang",
            True,
            CONFIG,
            f"SGLang {version} on Python {report.python} "
            f"(import and parse: {report.seconds:.1f} s)",
        )
    ]
    for spec, verdict in zip(specs, report.verdicts, strict=True):
        checks.append(_parser_check(cfg, spec, verdict, version, report.options))
        checks.append(_env_check(cfg, spec, version, report.env))
    return checks


def _flags(spec: LaunchSpec) -> list[str]:
    """The argv after `<python> -m <module>`: what SGLang's parser sees."""
    argv = list(spec.argv)
    return argv[3:] if len(argv) >= 3 and argv[1] == "-m" else argv[1:]


def _parser_check(
    cfg: Config, spec: LaunchSpec, verdict: Verdict, version: str, options: Sequence[str]
) -> Check:
    name = f"parser[{spec.profile}]"
    flags = _flags(spec)
    lines: list[str] = []
    for i, error in enumerate(verdict.errors):
        if i:
            lines.append(f"also rejected: {error}")
        hint = rejection_hint(error, options)
        if hint:
            lines.append(hint)
        named = error_flags(error)
        keys = [
            _where(cfg, spec.profile, n)
            for n, _ in flag_values(flags)
            if any(flag.startswith(f"--{n}") for flag in named)
        ]
        if keys:
            lines.append(f"(set at {', '.join(_at(cfg, k) for k in dict.fromkeys(keys))})")
    warnings = [f"{c.what}: {c.hint}" for c in known_changes(flags) if not c.rejected]
    warnings += [
        f"{short}: accepted only as an abbreviation of {full}; write {full[2:]} in full (a new "
        "flag with the same prefix makes it ambiguous, as --cuda-graph-max-bs became in 0.5.23)"
        for short, full in abbreviations(flags, options)
        if not any(short in e for e in verdict.errors)
    ]
    said = [ln for ln in verdict.output.splitlines() if ln.strip()]
    warnings += [f"SGLang says: {ln}" for ln in said if not any(ln in w for w in warnings)]
    if verdict.errors:
        more = len(verdict.errors) - 1
        message = f"SGLang {version} rejects the command line: {verdict.errors[0]}"
        if more:
            message += f" (and {more} more problem{'s' if more > 1 else ''}, below)"
        return Check(name, False, CONFIG, message, "\n".join(lines + warnings))
    count = sum(1 for t in flags if t.startswith("--"))
    message = f"SGLang {version} accepts the command line ({count} flags)"
    if warnings:
        return Check(name, True, CONFIG, message + ", with warnings", "\n".join(warnings), True)
    return Check(name, True, CONFIG, message)


def _env_check(
    cfg: Config, spec: LaunchSpec, version: str, findings: Mapping[str, EnvFinding]
) -> Check:
    name = f"env[{spec.profile}]"
    names = sglang_variables(spec.env)
    notes: list[str] = []
    for var in names:
        finding = findings.get(var)
        if var in KNOWN_ENV:
            notes.append(f"{var}: {KNOWN_ENV[var].hint}")
        elif finding is not None and finding.deprecated:
            notes.append(f"{var}: SGLang says: {finding.deprecated}")
        elif finding is not None and not finding.read_as:
            notes.append(
                f"{var}: SGLang {version} never mentions this variable in its source; it is "
                "ignored. Remove it or find its replacement in the SGLang release notes"
            )
        elif var.startswith("SGL_"):
            notes.append(f"{var}: the SGL_ prefix is deprecated; write SGLANG_{var[4:]}")
    if not names:
        return Check(name, True, CONFIG, "no SGLANG_* variables set")
    if notes:
        return Check(
            name,
            True,
            CONFIG,
            f"{len(names)} SGLANG_* variable(s), with warnings",
            "\n".join(notes),
            warning=True,
        )
    message = f"{len(names)} SGLANG_* variable(s), all read by SGLang {version}"
    return Check(name, True, CONFIG, message)


def run_checks(
    cfg: Config,
    *,
    profiles: tuple[str, ...] | None = None,
    gpu_count: Callable[[], int] | None = None,
    parser_timeout: float = PARSER_TIMEOUT,
    in_use: Callable[[int], Check | str] | None = None,
) -> list[Check]:
    """Every preflight check for the given profiles (default: primary and the fallback).

    Blocking (~2 s, most of it SGLang's import); the daemon runs it before its real work.
    `gpu_count` comes from the daemon's NVML layer; None skips the GPU check.
    """
    profiles = profiles or default_profiles(cfg)
    specs = [build(cfg, p) for p in profiles]
    sg = cfg.sglang
    checks = [check_interpreter(sg.python)]

    if not is_sglang_module(sg.module):
        why = f"module {sg.module} is not SGLang"
        checks.append(Check("sglang", True, CONFIG, f"{why}; import check skipped", skipped=True))
        checks.append(Check("parser", True, CONFIG, f"{why}; parser check skipped", skipped=True))
    elif checks[0].ok:
        workdir = sg.workdir if sg.workdir and os.path.isdir(sg.workdir) else None
        names = sorted({n for s in specs for n in sglang_variables(s.env)})
        report = run_sglang_parser(
            sg.python,
            [(_flags(s), s.env) for s in specs],
            env_names=names,
            cwd=workdir,
            timeout=parser_timeout,
        )
        checks.extend(_parser_checks(cfg, specs, report))

    checks.extend(host_checks(cfg, specs, gpu_count))
    checks.append(check_port(sg.host, sg.port, in_use))
    checks.append(check_caches(cfg))
    return checks


# The checks of the model and draft model directories: failing, the daemon is `waiting`.
MODEL_CHECKS = frozenset({"model_path", "draft_model_path"})


def host_checks(
    cfg: Config, specs: Sequence[LaunchSpec], gpu_count: Callable[[], int] | None
) -> list[Check]:
    """Model and draft paths, GPU count: what the daemon re-checks before every launch."""
    sg = cfg.sglang
    checks = [check_model_path("model_path", sg.model_path, "sglang.model_path", sg.workdir)]
    # Names from MODEL_CHECKS: a failure of either sends the daemon to `waiting`.
    drafts: dict[str, str] = {}
    for spec in specs:
        for flag in ("speculative-draft-model-path", "speculative-draft-model"):
            value = spec.args.get(flag)
            if isinstance(value, str) and value not in drafts:
                drafts[value] = _where(cfg, spec.profile, flag)
    for path, key in drafts.items():
        checks.append(check_model_path("draft_model_path", path, key, sg.workdir))
    checks.append(check_gpus(cfg, specs, gpu_count))
    return checks


def startup_checks(
    cfg: Config, gpu_count: Callable[[], int] | None
) -> tuple[list[Check], int | None]:
    """The checks `kimi-serve run` makes before it touches a GPU.

    Returns the checks and the exit status to stop with: 78 when any config-kind check failed
    (a restart cannot fix it, and systemd must not restart-loop on it); None when all passed or
    only host problems remain, which the daemon retries with backoff (`failures(checks)` says
    whether to wait).
    """
    checks = run_checks(cfg, gpu_count=gpu_count)
    return checks, EX_CONFIG if failures(checks, CONFIG) else None


# --------------------------------------------------------------------------------------------
# `kimi-serve preflight`
# --------------------------------------------------------------------------------------------


def nvml_gpu_count(cfg: Config, open_nvml: Callable[[], Any]) -> Callable[[], int]:
    """Count the managed GPUs (`gpus.devices`) through supervisor.gpu.nvml."""

    def count() -> int:
        try:
            nvml_layer = importlib.import_module("supervisor.gpu.nvml")
        except ImportError as exc:
            raise GpuCountUnavailable(f"supervisor.gpu.nvml cannot be imported ({exc})") from None
        nvml = open_nvml()
        try:
            return len(nvml_layer.select(nvml.snapshot(), cfg.gpus.devices))
        finally:
            nvml.close()

    return count


def run_preflight_command(
    cfg: Config,
    out: TextIO,
    *,
    gpu_count: Callable[[], int] | None = None,
    open_nvml: Callable[[], Any] | None = None,
    as_json: bool = False,
) -> int:
    """The body of `kimi-serve preflight`: every check, one per line (or one JSON document);
    0 / 78 / 1. A port held by the running daemon's own SGLang passes (serving.py): the host
    is serving, and a restart frees the port before the next launch binds it."""
    if gpu_count is None:
        if open_nvml is None:
            from supervisor.gpu.nvml import PynvmlNvml

            open_nvml = PynvmlNvml
        gpu_count = nvml_gpu_count(cfg, open_nvml)
    counter = gpu_count
    start = time.monotonic()
    checks = run_checks(cfg, gpu_count=counter, in_use=lambda port: serving.recognise(cfg, port))
    code = exit_code(checks)
    verdict = {
        0: "ok: the launch can go ahead",
        EX_CONFIG: "config problem: fix the config (a restart will not help)",
        EXIT_HOST: "host not ready: `kimi-serve run` would wait and retry",
    }[code]
    is_serving = any(c.serving for c in checks)
    if code == 0 and is_serving:
        verdict = "serving: kimi-serve runs SGLang here; a restart can go ahead"
    seconds = time.monotonic() - start
    if as_json:
        doc = {
            "config": cfg.path,
            "profiles": list(default_profiles(cfg)),
            "exit_code": code,
            "verdict": verdict,
            "serving": is_serving,
            "seconds": round(seconds, 3),
            "checks": [c.as_dict() for c in checks],
        }
        json.dump(doc, out, indent=2)
        out.write("\n")
        out.flush()
        return code
    profiles = ", ".join(default_profiles(cfg))
    print(f"kimi-serve preflight: {cfg.path} (profiles: {profiles})", file=out)
    for check in checks:
        print(check.render(), file=out)
    counts = f"{len(failures(checks))} failed, {sum(c.warning for c in checks)} warning(s)"
    print(f"{verdict} ({len(checks)} checks, {counts}, {seconds:.1f} s)", file=out)
    out.flush()
    return code
