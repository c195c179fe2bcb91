"""Preflight: catch a launch that cannot work in seconds, not ten minutes into a model load.

SGLang renames flags between releases. With 0.5.23 the seed incident's `--cuda-graph-max-bs 128`
is an "ambiguous option" (it prefixes both `--cuda-graph-max-bs-decode` and `-prefill`), and
SGLang says so only after its Python start-up; a port held by a leftover process fails the launch
only after the whole model has loaded (sglang-facts.md). So before any GPU is touched:

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

import dataclasses
import difflib
import errno
import importlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import psutil

from supervisor.command import LaunchSpec, build
from supervisor.config import PRIMARY, ArgValue, Config

CONFIG: Literal["config"] = "config"
HOST: Literal["host"] = "host"
CheckKind = Literal["config", "host"]

EX_CONFIG = 78  # EX_CONFIG from sysexits.h; the contract's exit status for a config problem
EXIT_HOST = 1  # `kimi-serve preflight`: the host is not ready (yet)

# The first cold import of torch + SGLang from a slow disk can take tens of seconds; a warm one
# takes ~1.5 s. Past this the check is a host problem (a hung mount), not a verdict.
PARSER_TIMEOUT = 180.0
# What the parser probe prints before its JSON answer, so noise on stdout cannot be mistaken
# for it.
_MARKER = "@@kimi-serve-preflight@@ "


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One preflight finding. `ok` with `warning` is a pass worth reading (a deprecated flag);
    `ok` with `skipped` did not apply here (not SGLang, GPUs not managed)."""

    name: str
    ok: bool
    kind: CheckKind
    message: str
    hint: str = ""
    warning: bool = False
    skipped: bool = False

    @property
    def status(self) -> str:
        if not self.ok:
            return "FAIL"
        if self.skipped:
            return "skip"
        return "WARN" if self.warning else "ok"

    def render(self) -> str:
        line = f"{self.status:<5} {self.name:<20} {self.message}"
        if self.hint:
            line += "".join(f"\n{'':27}{part}" for part in self.hint.splitlines())
        return line

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "status": self.status}


def failures(checks: Iterable[Check], kind: CheckKind | None = None) -> list[Check]:
    return [c for c in checks if not c.ok and (kind is None or c.kind == kind)]


def exit_code(checks: Sequence[Check]) -> int:
    """0 all passed; 78 any config problem (a restart will not fix it); else 1 (host)."""
    if failures(checks, CONFIG):
        return EX_CONFIG
    return EXIT_HOST if failures(checks) else 0


def summary(checks: Sequence[Check], limit: int = 400) -> str:
    """One line for systemd's STATUS= and the log: the first failure (config ones first)."""
    failed = sorted(failures(checks), key=lambda c: c.kind != CONFIG)
    if not failed:
        warned = [c for c in checks if c.warning]
        extra = f", {len(warned)} warning(s): {warned[0].name}" if warned else ""
        return f"preflight ok ({len(checks)} checks{extra})"
    first = failed[0]
    more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
    text = f"preflight {first.kind} problem{more}: {first.name}: {first.message}"
    if first.hint:
        text += " | hint: " + " ".join(first.hint.split())
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# Known renames and deprecations
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownChange:
    """A flag, flag value or environment variable that changed meaning in some SGLang release.

    `rejected`: current SGLang refuses it (the launch fails); otherwise it still works with a
    deprecation warning, or (for variables) is silently ignored.
    """

    what: str
    rejected: bool
    hint: str


def _flag(what: str, hint: str, rejected: bool = True) -> tuple[str, KnownChange]:
    return what, KnownChange(f"--{what}", rejected, hint)


# Read from SGLang 0.5.23 (server_args.py add_cli_args, arg_groups/serving_hook.py
# handle_deprecated_args, environ.py) and SGLang's docs/references/deprecated.md. Keys are
# flag names without dashes, as written under `sglang.args`.
KNOWN_FLAGS: dict[str, KnownChange] = dict(
    [
        _flag(
            "cuda-graph-max-bs",
            "removed in SGLang 0.5.23: write cuda-graph-max-bs-decode: N (and "
            "cuda-graph-max-bs-prefill: N to also capture prefill graphs); the old name "
            "prefixes both, hence 'ambiguous option'",
        ),
        _flag(
            "cuda-graph-bs",
            "removed in SGLang 0.5.23: write cuda-graph-bs-decode: [...] (and "
            "cuda-graph-bs-prefill: [...])",
        ),
        _flag("enable-ep-moe", "removed: write ep-size: N with the same N as tp-size"),
        _flag("enable-deepep-moe", "removed: write moe-a2a-backend: deepep"),
        _flag(
            "enable-flashinfer-cutlass-moe",
            "removed: write moe-runner-backend: flashinfer_cutlass",
        ),
        _flag(
            "enable-flashinfer-cutedsl-moe",
            "removed: write moe-runner-backend: flashinfer_cutedsl",
        ),
        _flag(
            "enable-flashinfer-trtllm-moe",
            "removed: write moe-runner-backend: flashinfer_trtllm",
        ),
        _flag("enable-flashinfer-mxfp4-moe", "removed: write moe-runner-backend: flashinfer_mxfp4"),
        _flag("enable-triton-kernel-moe", "removed: write moe-runner-backend: triton_kernel"),
        _flag("enable-flashinfer-mla", "removed: write attention-backend: flashinfer"),
        _flag("enable-flashmla", "removed: write attention-backend: flashmla"),
        _flag(
            "enable-flashinfer-allreduce-fusion",
            "deprecated in SGLang 0.5.23 (still works): write "
            "flashinfer-allreduce-fusion-backend: auto instead",
            rejected=False,
        ),
        _flag(
            "disable-cuda-graph",
            "deprecated in SGLang 0.5.23 (still works): write cuda-graph-backend-decode: "
            "disabled and cuda-graph-backend-prefill: disabled",
            rejected=False,
        ),
        _flag(
            "enable-dp-attention",
            "deprecated in SGLang 0.5.23 (still works): write attn-dp-size: N instead of "
            "dp-size: N with enable-dp-attention",
            rejected=False,
        ),
        _flag(
            "monokernel-backend",
            "deprecated in SGLang 0.5.23 (still works): write enable-amd-monokernel: true",
            rejected=False,
        ),
        _flag(
            "grpc-mode",
            "deprecated in SGLang 0.5.23 (still works): write smg-grpc-mode: true (legacy SMG "
            "server) or grpc-port: N (native gRPC server)",
            rejected=False,
        ),
        _flag(
            "disable-fast-image-processor",
            "deprecated in SGLang 0.5.23 (still works): write image-processor-backend: pil",
            rejected=False,
        ),
    ]
)

# (flag, value) -> change; the flags that take one of these values.
_ATTENTION_FLAGS = (
    "attention-backend",
    "decode-attention-backend",
    "prefill-attention-backend",
    "speculative-draft-attention-backend",
)
KNOWN_VALUES: dict[tuple[str, str], KnownChange] = {
    ("tool-call-parser", "qwen25"): KnownChange(
        "--tool-call-parser qwen25", False, "deprecated (still works): write tool-call-parser: qwen"
    ),
    ("tool-call-parser", "glm45"): KnownChange(
        "--tool-call-parser glm45", False, "deprecated (still works): write tool-call-parser: glm"
    ),
    ("lora-backend", "flashinfer"): KnownChange(
        "--lora-backend flashinfer", True, "removed: write lora-backend: triton"
    ),
    ("load-balance-method", "minimum_tokens"): KnownChange(
        "--load-balance-method minimum_tokens",
        True,
        "removed: write load-balance-method: round_robin",
    ),
    **{
        (flag, old): KnownChange(
            f"--{flag} {old}", False, f"deprecated in SGLang 0.5.23 (still works): {flag}: {new}"
        )
        for flag in _ATTENTION_FLAGS
        for old, new in (("compressed", "dsv4"), ("tokenspeed_mla", "cutedsl_mla"))
    },
}

KNOWN_ENV: dict[str, KnownChange] = {
    "SGLANG_ENABLE_SPEC_V2": KnownChange(
        "SGLANG_ENABLE_SPEC_V2",
        False,
        "no longer read by SGLang 0.5.23: spec v2 is the only EAGLE path and the overlap "
        "scheduler is on unless disable-overlap-schedule is set; remove the variable. kimi-serve "
        "confirms after load, through /server_info, that overlap and EAGLE are really on",
    ),
    "SGLANG_ENABLE_FLASHINFER_FP8_GEMM": KnownChange(
        "SGLANG_ENABLE_FLASHINFER_FP8_GEMM",
        False,
        "removed: write fp8-gemm-backend: flashinfer_trtllm under sglang.args",
    ),
    "SGLANG_ENABLE_FLASHINFER_GEMM": KnownChange(
        "SGLANG_ENABLE_FLASHINFER_GEMM",
        False,
        "removed: write fp8-gemm-backend: flashinfer_trtllm under sglang.args",
    ),
    "SGLANG_SUPPORT_CUTLASS_BLOCK_FP8": KnownChange(
        "SGLANG_SUPPORT_CUTLASS_BLOCK_FP8",
        False,
        "removed: write fp8-gemm-backend: cutlass under sglang.args",
    ),
    "SGLANG_CUTLASS_MOE": KnownChange(
        "SGLANG_CUTLASS_MOE", False, "removed: write moe-runner-backend: cutlass under sglang.args"
    ),
}


def flag_values(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """(name without dashes, first value or None) for every `--flag` token of an argv."""
    out: list[tuple[str, str | None]] = []
    for i, token in enumerate(argv):
        if not token.startswith("--") or token == "--":
            continue
        name, eq, inline = token[2:].partition("=")
        if eq:
            out.append((name, inline))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append((name, argv[i + 1]))
        else:
            out.append((name, None))
    return out


def known_changes(argv: Sequence[str]) -> list[KnownChange]:
    """Table entries that apply to this argv, in argv order, each once."""
    found: list[KnownChange] = []
    for name, value in flag_values(argv):
        for change in (KNOWN_FLAGS.get(name), KNOWN_VALUES.get((name, value or ""))):
            if change is not None and change not in found:
                found.append(change)
    return found


def abbreviations(argv: Sequence[str], options: Iterable[str]) -> list[tuple[str, str]]:
    """(as written, full name) for flags argparse accepted only as an unambiguous prefix.

    Such a flag breaks the day SGLang adds another flag with the same prefix: that is exactly
    how `--cuda-graph-max-bs` became an "ambiguous option" in 0.5.23.
    """
    known = set(options)
    out: list[tuple[str, str]] = []
    for token in argv:
        if not token.startswith("--") or token == "--":
            continue
        written = token.partition("=")[0]
        if written in known:
            continue
        matches = sorted(o for o in known if o.startswith(written))
        if len(matches) == 1 and (written, matches[0]) not in out:
            out.append((written, matches[0]))
    return out


_AMBIGUOUS = re.compile(r"ambiguous option: (--[\w-]+) could match (.+)$")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.+)$")
_INVALID_CHOICE = re.compile(r"argument ([^:]+): invalid choice: '([^']*)' \(choose from (.+)\)")
_INVALID_VALUE = re.compile(r"argument ([^:]+): invalid (\w+) value: '([^']*)'")
_EXPECTED = re.compile(r"argument ([^:]+): expected")


def error_flags(error: str) -> list[str]:
    """The flags an argparse error is about (as SGLang's parser names them)."""
    if m := _AMBIGUOUS.search(error):
        return [m.group(1)]
    if m := _UNRECOGNIZED.search(error):
        return [t.partition("=")[0] for t in m.group(1).split() if t.startswith("--")]
    if m := re.match(r"argument ([^:]+):", error):
        return m.group(1).split("/")
    return []


def rejection_hint(error: str, options: Iterable[str] = ()) -> str:
    """What to do about one rejection by SGLang's parser (whose message is shown as is)."""
    if m := _AMBIGUOUS.search(error):
        change = KNOWN_FLAGS.get(m.group(1)[2:])
        if change is not None:
            return f"{change.what}: {change.hint}"
        return (
            f"{m.group(1)} is no longer a complete flag name in this SGLang; write the full "
            f"name of the one you mean: {m.group(2)}"
        )
    if m := _UNRECOGNIZED.search(error):
        parts: list[str] = []
        known = sorted(set(options))
        for flag in error_flags(error):
            change = KNOWN_FLAGS.get(flag[2:])
            close = difflib.get_close_matches(flag, known, n=2, cutoff=0.75)
            if change is not None:
                parts.append(f"{flag}: {change.hint}")
            elif close:
                guess = " or ".join(close)
                parts.append(f"{flag}: not a flag of this SGLang; did you mean {guess}?")
            else:
                parts.append(
                    f"{flag}: not a flag of this SGLang; it was removed or renamed: look in the "
                    "SGLang release notes, or `<sglang python> -m sglang.launch_server --help`"
                )
        return "\n".join(parts) or "a value without a flag: check list values in the config"
    if m := _INVALID_CHOICE.search(error):
        flags, value = m.group(1).split("/"), m.group(2)
        for flag in flags:
            change = KNOWN_VALUES.get((flag[2:], value))
            if change is not None:
                return f"{change.what}: {change.hint}"
        # Python < 3.12.8 quotes the choices, newer releases do not.
        choices = re.findall(r"'([^']*)'", m.group(3)) or m.group(3).split(", ")
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
        what = f"{flags[0]} {value!r} is not a choice of this SGLang"
        return f"{what}; did you mean {close[0]!r}?" if close else f"{what}; pick a listed one"
    if m := _INVALID_VALUE.search(error):
        return f"{m.group(1).split('/')[0]} needs a value of type {m.group(2)}, not {m.group(3)!r}"
    if m := _EXPECTED.search(error):
        return f"{m.group(1).split('/')[0]} needs a value in the config (or true for a bare flag)"
    return ""


def _env_names(env: Mapping[str, str]) -> list[str]:
    return sorted(n for n in env if n.startswith(("SGLANG_", "SGL_")))


# --------------------------------------------------------------------------------------------
# SGLang's own parser, in a subprocess of the configured interpreter
# --------------------------------------------------------------------------------------------

# Runs inside the SGLang interpreter. Reads {"requests": [{"argv", "env"}], "env_names"} on
# stdin, answers one JSON line after _MARKER. It only builds the parser and parses: never
# ServerArgs.from_cli_args / resolve_once, which read the model's config and probe the GPU.
_PROBE = r"""
import argparse, contextlib, io, json, logging, os, re, sys, warnings
real_stdout, sys.stdout = sys.stdout, sys.stderr
request = json.load(sys.stdin)
answer = {"python": sys.version.split()[0], "version": None, "import_error": None,
          "options": [], "results": [], "env": {}}

def emit():
    real_stdout.write(MARKER + json.dumps(answer) + "\n")
    real_stdout.flush()

try:
    from importlib.metadata import version
    answer["version"] = version("sglang")
except Exception:
    pass
try:
    import sglang
    from sglang.srt.server_args import ServerArgs
except BaseException as exc:
    answer["import_error"] = f"{type(exc).__name__}: {exc}"
    emit()
    sys.exit(0)
if answer["version"] is None:
    answer["version"] = getattr(sglang, "__version__", None)

class Rejected(Exception):
    pass

class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Rejected(message)

    def exit(self, status=0, message=None):
        raise Rejected((message or "").strip() or f"the parser exited with status {status}")

ansi = re.compile(r"\x1b\[[0-9;]*m")

def culprits(message):
    # The flags an error names, so the next pass can go on without them.
    m = re.match(r"ambiguous option: (--[^ =]+)", message)
    if m or (m := re.match(r"argument ([^:]+):", message)):
        return m.group(1).split("/")
    m = re.match(r"unrecognized arguments: (.*)", message)
    if m:
        return [t.partition("=")[0] for t in m.group(1).split() if t.startswith("--")]
    return []

def without(argv, names):
    kept, drop = [], False
    for token in argv:
        if token.startswith("--"):
            written = token.partition("=")[0]
            drop = any(name.startswith(written) for name in names)
        if not drop:
            kept.append(token)
    return kept

for item in request["requests"]:
    saved = dict(os.environ)
    os.environ.update(item["env"])
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    logging.getLogger().addHandler(handler)
    errors, argv = [], list(item["argv"])
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer), \
                warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda m, c, *a, **k: buffer.write(f"{c.__name__}: {m}\n")
            parser = Parser(prog="sglang serve")
            ServerArgs.add_cli_args(parser)
            if not answer["options"]:
                answer["options"] = sorted(parser._option_string_actions)
            # argparse stops at the first error; drop the flag it named and parse again, so
            # one preflight run reports every rejected flag.
            for _ in range(20):
                try:
                    parser.parse_args(argv)
                    break
                except Rejected as exc:
                    errors.append(str(exc))
                    rest = without(argv, culprits(str(exc)))
                    if rest == argv:
                        break
                    argv = rest
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        logging.getLogger().removeHandler(handler)
        os.environ.clear()
        os.environ.update(saved)
    lines = dict.fromkeys(ansi.sub("", buffer.getvalue()).strip().splitlines())
    answer["results"].append({"errors": errors, "output": "\n".join(lines)})

names = request["env_names"]
if names:
    from pathlib import Path
    spellings = {n: [n] + (["SGLANG_" + n[4:]] if n.startswith("SGL_") else []) for n in names}
    wanted = {s.encode() for forms in spellings.values() for s in forms}
    found = set()
    for path in Path(sglang.__file__).parent.rglob("*.py"):
        data = path.read_bytes()
        found |= {w for w in wanted - found if w in data}
        if found == wanted:
            break
    try:
        from sglang.srt.environ import _DEPRECATED_ENVS as deprecated
    except Exception:
        deprecated = {}
    for name in names:
        entry, note = deprecated.get(name), None
        if entry is not None:
            note = f"Environment variable {name} is deprecated."
            if getattr(entry, "replacement", None):
                note += f" Please use {entry.replacement} instead."
            if getattr(entry, "note", None):
                note += f" {entry.note}"
        answer["env"][name] = {
            "read_as": [s for s in spellings[name] if s.encode() in found],
            "deprecated": note,
        }
emit()
""".replace("MARKER", repr(_MARKER))


@dataclass(frozen=True)
class Verdict:
    """SGLang's parser on one argv: every error it raised (none: accepted), and what it
    printed (deprecation warnings)."""

    errors: tuple[str, ...]
    output: str

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass(frozen=True)
class EnvFinding:
    read_as: tuple[str, ...]  # the spellings that occur in SGLang's source (empty: never read)
    deprecated: str | None  # SGLang's own deprecation message for the variable


@dataclass(frozen=True)
class ParserReport:
    """One run of the probe. `failure` is set when it gave no answer at all."""

    seconds: float
    failure: str | None = None
    timed_out: bool = False
    python: str | None = None
    version: str | None = None
    import_error: str | None = None
    options: tuple[str, ...] = ()
    verdicts: tuple[Verdict, ...] = ()
    env: Mapping[str, EnvFinding] = field(default_factory=dict)


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_sglang_parser(
    python: str,
    requests: Sequence[tuple[Sequence[str], Mapping[str, str]]],
    *,
    env_names: Sequence[str] = (),
    cwd: str | None = None,
    timeout: float = PARSER_TIMEOUT,
) -> ParserReport:
    """Parse each (flags, extra env) with SGLang's own parser, all in one subprocess of
    `python` (importing torch + SGLang is what costs ~1.5 s, so it is paid once)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    payload = json.dumps(
        {
            "requests": [{"argv": list(argv), "env": dict(extra)} for argv, extra in requests],
            "env_names": list(env_names),
        }
    )
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE],
            input=payload,
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ParserReport(
            time.monotonic() - start,
            failure=f"importing SGLang and parsing took longer than {timeout:g} s",
            timed_out=True,
        )
    except OSError as exc:
        return ParserReport(time.monotonic() - start, failure=f"cannot run {python}: {exc}")
    seconds = time.monotonic() - start
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARKER)]
    if not lines:
        detail = _tail(proc.stderr) or _tail(proc.stdout) or "no output"
        return ParserReport(
            seconds, failure=f"{python} exited with status {proc.returncode}: {detail}"
        )
    try:
        raw = json.loads(lines[-1][len(_MARKER) :])
        results = raw.get("results") or ()
    except (ValueError, AttributeError):
        return ParserReport(seconds, failure=f"{python} gave an unreadable answer")
    if raw.get("import_error") is None and len(results) != len(requests):
        return ParserReport(
            seconds, failure=f"{python} answered {len(results)} of {len(requests)} command lines"
        )
    return ParserReport(
        seconds,
        python=raw.get("python"),
        version=raw.get("version"),
        import_error=raw.get("import_error"),
        options=tuple(raw.get("options") or ()),
        verdicts=tuple(
            Verdict(tuple(r.get("errors") or ()), r.get("output") or "") for r in results
        ),
        env={
            name: EnvFinding(tuple(v.get("read_as") or ()), v.get("deprecated"))
            for name, v in (raw.get("env") or {}).items()
        },
    )


def sglang_version(python: str, timeout: float = 30.0) -> str | None:
    """The SGLang version installed for `python` (package metadata: no import, ~50 ms);
    None when it is not installed or the interpreter does not run."""
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        proc = subprocess.run(
            [python, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = proc.stdout.strip()
    return version if proc.returncode == 0 and version else None


def is_sglang_module(module: str) -> bool:
    return module == "sglang" or module.startswith("sglang.")


def sglang_version_for(cfg: Config) -> str | None:
    """The version for `kimi_serve_build_info{sglang_version}`: None when the configured module
    is not SGLang (the stand-in) or SGLang is not installed for the interpreter."""
    if not is_sglang_module(cfg.sglang.module):
        return None
    return sglang_version(cfg.sglang.python)


# --------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------


def default_profiles(cfg: Config) -> tuple[str, ...]:
    """The profiles a run may launch: primary, and the fallback it switches to."""
    fallback = cfg.restart.fallback_profile
    return (PRIMARY,) if fallback in (None, PRIMARY) else (PRIMARY, fallback)


def _where(cfg: Config, profile: str, flag: str) -> str:
    """The config key a flag of the launched argv comes from."""
    top = {"model-path": "sglang.model_path", "host": "sglang.host", "port": "sglang.port"}
    if flag in top:
        return top[flag]
    if profile != PRIMARY and flag in cfg.profile(profile).args:
        return f"profiles.{profile}.args.{flag}"
    return f"sglang.args.{flag}"


def check_interpreter(python: str) -> Check:
    name = "interpreter"
    if os.sep not in python:
        found = shutil.which(python)
        if found is None:
            return Check(
                name,
                False,
                CONFIG,
                f"sglang.python {python!r} is not on PATH",
                "set sglang.python to the absolute path of SGLang's virtualenv interpreter",
            )
        python = found
    if not os.path.lexists(python):
        return Check(
            name,
            False,
            CONFIG,
            f"sglang.python {python} does not exist",
            "set sglang.python to the interpreter of the virtualenv SGLang is installed in",
        )
    if not os.path.exists(python):
        return Check(
            name,
            False,
            CONFIG,
            f"sglang.python {python} is a broken link (to {os.readlink(python)})",
            "the Python the virtualenv was made from is gone (an OS upgrade?); recreate the "
            "virtualenv and reinstall SGLang",
        )
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        return Check(name, False, CONFIG, f"sglang.python {python} is not an executable file")
    return Check(name, True, CONFIG, python)


def check_port(host: str, port: int) -> Check:
    """Bind host:port the way SGLang's HTTP server will (SO_REUSEADDR, as uvicorn sets it, so
    a socket in TIME_WAIT is not mistaken for a busy port)."""
    name, where = "port", f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return Check(
            name,
            False,
            HOST,
            f"cannot resolve sglang.host {host!r}: {exc.strerror}",
            "use an IP address, or fix name resolution on this host",
        )
    family, kind, proto, _, sockaddr = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return Check(
                name,
                False,
                HOST,
                f"{where} is in use{_holder(port)}",
                "SGLang binds its port only after the model has loaded, so this would fail the "
                "launch ten minutes in. A leftover SGLang? `kimi-serve gpu-clean --dry-run`; "
                f"or `ss -ltnp 'sport = :{port}'`",
            )
        if exc.errno == errno.EACCES:
            return Check(
                name,
                False,
                CONFIG,
                f"not allowed to bind {where}: {exc.strerror}",
                "ports below 1024 need privileges; pick another sglang.port",
            )
        if exc.errno == errno.EADDRNOTAVAIL:
            return Check(
                name,
                False,
                HOST,
                f"{host} is not an address of this host (yet)",
                "an interface that is not up yet, or a wrong sglang.host",
            )
        return Check(name, False, HOST, f"cannot bind {where}: {exc.strerror or exc}")
    return Check(name, True, HOST, f"{where} is free")


def _holder(port: int) -> str:
    """' (held by pid N: name)' where psutil can see the listener; '' otherwise."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return ""
    for conn in conns:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return ""
            try:
                proc = psutil.Process(conn.pid)
                what = " ".join(proc.cmdline()[:4]) or proc.name()
            except psutil.Error:
                what = "?"
            return f" (held by pid {conn.pid}: {what})"
    return ""


# A hub repo id ("org/name"): SGLang downloads it at load time; nothing local to check.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_path(name: str, path: str, key: str, workdir: str | None = None) -> Check:
    """A model directory must exist and hold config.json.

    Missing, or an empty directory, is a host problem: the usual cause is a network mount not
    up yet (an unmounted mount point is an empty directory), which clears by itself. A directory
    with files but no config.json, or a file, is a config problem: the path points at the wrong
    place, and no restart will fix that.
    """
    local = Path(path).expanduser()
    if not local.is_absolute() and workdir:
        local = Path(workdir) / local
    if not local.exists():
        if not path.startswith((".", "/", "~")) and _REPO_ID.match(path):
            return Check(
                name,
                True,
                HOST,
                f"{key} {path!r} is not a local path; taken as a hub repo id (SGLang downloads "
                "it at load time)",
                skipped=True,
            )
        return Check(
            name,
            False,
            HOST,
            f"{key} {local} does not exist",
            "a network mount not up yet clears by itself; otherwise fix the path",
        )
    if not local.is_dir():
        return Check(
            name,
            False,
            CONFIG,
            f"{key} {local} is a file, not a model directory",
            "point it at the directory that holds config.json and the weights",
        )
    try:
        empty = not any(local.iterdir())
        has_config = (local / "config.json").is_file()
    except PermissionError:
        return Check(
            name,
            False,
            CONFIG,
            f"{key} {local} is not readable by this user",
            "SGLang runs as the daemon's user; give it read access",
        )
    if empty:
        return Check(
            name,
            False,
            HOST,
            f"{key} {local} is empty",
            "an unmounted mount point? it clears once the mount is up",
        )
    if not has_config:
        return Check(
            name,
            False,
            CONFIG,
            f"{key} {local} has no config.json",
            "point it at the model directory itself (the one holding config.json), not a parent",
        )
    return Check(name, True, HOST, f"{local} (config.json present)")


def _int_arg(args: Mapping[str, ArgValue], *names: str) -> int | None:
    for name in names:
        value = args.get(name)
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.isdigit():
            return int(value)
    return None


def gpus_needed(spec: LaunchSpec) -> int:
    """GPUs this host must have for one launch: tp x pp, split over --nnodes hosts."""
    pp = _int_arg(spec.args, "pp-size", "pipeline-parallel-size", "pp") or 1
    nnodes = _int_arg(spec.args, "nnodes") or 1
    return max(1, -(-(spec.tp_size * pp) // nnodes))


class GpuCountUnavailable(Exception):
    """Nothing can count GPUs here; the GPU check is skipped with this message."""


def check_gpus(
    cfg: Config, specs: Sequence[LaunchSpec], gpu_count: Callable[[], int] | None
) -> Check:
    name = "gpus"
    if not cfg.gpus.manage:
        return Check(name, True, HOST, "not checked: gpus.manage is false", skipped=True)
    if gpu_count is None:
        return Check(name, True, HOST, "not checked: no GPU count available", skipped=True)
    need = max(gpus_needed(s) for s in specs)
    which = max(specs, key=gpus_needed).profile
    try:
        have = gpu_count()
    except GpuCountUnavailable as exc:
        return Check(name, True, HOST, f"not checked: {exc}", skipped=True)
    except Exception as exc:
        return Check(name, False, HOST, f"cannot count GPUs: {exc}")
    if have < need:
        return Check(
            name,
            False,
            HOST,
            f"{have} GPU(s) visible, profile {which} needs {need} (tp-size x pp-size)",
            "a GPU fallen off the bus or a driver reload shows in `nvidia-smi`; check gpus.devices",
        )
    return Check(name, True, HOST, f"{have} GPU(s) visible, {need} needed")


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
            lines.append(f"(set at {', '.join(dict.fromkeys(keys))} in {cfg.path})")
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
    names = _env_names(spec.env)
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
        names = sorted({n for s in specs for n in _env_names(s.env)})
        report = run_sglang_parser(
            sg.python,
            [(_flags(s), s.env) for s in specs],
            env_names=names,
            cwd=workdir,
            timeout=parser_timeout,
        )
        checks.extend(_parser_checks(cfg, specs, report))

    checks.extend(host_checks(cfg, specs, gpu_count))
    checks.append(check_port(sg.host, sg.port))
    return checks


def host_checks(
    cfg: Config, specs: Sequence[LaunchSpec], gpu_count: Callable[[], int] | None
) -> list[Check]:
    """Model and draft paths, GPU count: what the daemon re-checks before every launch."""
    sg = cfg.sglang
    checks = [check_model_path("model_path", sg.model_path, "sglang.model_path", sg.workdir)]
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


def nvml_gpu_count(cfg: Config) -> Callable[[], int]:
    """Count the managed GPUs (`gpus.devices`) through supervisor.gpu's NVML layer."""

    def count() -> int:
        try:
            gpu = importlib.import_module("supervisor.gpu")
        except ImportError as exc:
            raise GpuCountUnavailable(f"supervisor.gpu cannot be imported ({exc})") from None
        nvml = gpu.open_nvml()
        try:
            return len(gpu.select(nvml.snapshot(), cfg.gpus.devices))
        finally:
            nvml.close()

    return count


def run_preflight_command(
    cfg: Config, out: TextIO, *, gpu_count: Callable[[], int] | None = None
) -> int:
    """The body of `kimi-serve preflight`: every check, one per line; 0 / 78 / 1."""
    counter = gpu_count if gpu_count is not None else nvml_gpu_count(cfg)
    start = time.monotonic()
    checks = run_checks(cfg, gpu_count=counter)
    profiles = ", ".join(default_profiles(cfg))
    print(f"kimi-serve preflight: {cfg.path} (profiles: {profiles})", file=out)
    for check in checks:
        print(check.render(), file=out)
    code = exit_code(checks)
    verdict = {
        0: "ok: the launch can go ahead",
        EX_CONFIG: "config problem: fix the config (a restart will not help)",
        EXIT_HOST: "host not ready: `kimi-serve run` would wait and retry",
    }[code]
    counts = f"{len(failures(checks))} failed, {sum(c.warning for c in checks)} warning(s)"
    print(f"{verdict} ({len(checks)} checks, {counts}, {time.monotonic() - start:.1f} s)", file=out)
    out.flush()
    return code
