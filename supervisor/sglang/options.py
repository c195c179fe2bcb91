"""What kimi-serve knows about SGLang itself, apart from the checks that judge a config with it.

Two kinds of knowledge, both tied to an SGLang release rather than to this host or config:

- a table of flags, flag values and environment variables that SGLang renamed, removed or
  deprecated, with what to write instead (read from SGLang's source and its deprecated.md);
- the installed SGLang's own argument parser, asked in one subprocess of the configured
  interpreter, which is the only authority on what that release accepts.

It is pure apart from that one subprocess call. `preflight` turns the answers into checks;
when SGLang is upgraded, this is the module to update (docs/preflight.md).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# The first cold import of torch + SGLang from a slow disk can take tens of seconds; a warm one
# takes ~1.5 s. Past this the check is a host problem (a hung mount), not a verdict.
PARSER_TIMEOUT = 180.0
# What the parser probe prints before its JSON answer, so noise on stdout cannot be mistaken
# for it.
_MARKER = "@@kimi-serve-preflight@@ "


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


def sglang_variables(env: Mapping[str, str]) -> list[str]:
    """The names in `env` that SGLang reads (SGLANG_*) or once read (the SGL_* prefix)."""
    return sorted(n for n in env if n.startswith(("SGLANG_", "SGL_")))


# --------------------------------------------------------------------------------------------
# SGLang's own parser, in a subprocess of the configured interpreter
# --------------------------------------------------------------------------------------------

# The program that runs inside the SGLang interpreter (a file of its own, run by path: that
# interpreter has no kimi-serve installed). It reads {"requests": [{"argv", "env"}], "env_names"}
# on stdin and answers one JSON line after the marker given as its argument. It only builds the
# parser and parses: never ServerArgs.from_cli_args / resolve_once, which read the model's
# config and probe the GPU.
PARSER_PROGRAM = Path(__file__).with_name("programs") / "parser_probe.py"


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
            [python, str(PARSER_PROGRAM), _MARKER],
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
