"""SGLang's own argument parser, asked from inside the SGLang interpreter.

Run by path, not imported: `<sglang python> parser_probe.py MARKER`, by
`supervisor.sglang.options.run_sglang_parser`. That interpreter has no kimi-serve installed, so
this file imports nothing but the standard library and SGLang, and keeps to Python 3.10 (the
oldest SGLang 0.5.23 supports).

Reads {"requests": [{"argv", "env"}], "env_names"} on stdin; answers one JSON line after MARKER
on stdout (anything else SGLang prints goes to stderr). It only builds the parser and parses:
never ServerArgs.from_cli_args / resolve_once, which read the model's config and probe the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn, TextIO

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# The flags an error names, so the next pass can go on without them.
AMBIGUOUS = re.compile(r"ambiguous option: (--[^ =]+)")
ARGUMENT = re.compile(r"argument ([^:]+):")
UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
# argparse stops at the first error; preflight drops the flag it named and parses again, so
# one run reports every rejected flag, at most this many.
MAX_PASSES = 20


class Rejected(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise Rejected(message)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise Rejected((message or "").strip() or f"the parser exited with status {status}")


def culprits(message: str) -> list[str]:
    m = AMBIGUOUS.match(message)
    if m or (m := ARGUMENT.match(message)):
        return m.group(1).split("/")
    m = UNRECOGNIZED.match(message)
    if m:
        return [t.partition("=")[0] for t in m.group(1).split() if t.startswith("--")]
    return []


def without(argv: list[str], names: list[str]) -> list[str]:
    kept, drop = [], False
    for token in argv:
        if token.startswith("--"):
            written = token.partition("=")[0]
            drop = any(name.startswith(written) for name in names)
        if not drop:
            kept.append(token)
    return kept


def parse_one(server_args: Any, item: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    saved = dict(os.environ)
    os.environ.update(item["env"])
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    logging.getLogger().addHandler(handler)
    errors: list[str] = []
    argv = list(item["argv"])

    def show(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
        buffer.write(f"{category.__name__}: {message}\n")

    try:
        with (
            contextlib.redirect_stdout(buffer),
            contextlib.redirect_stderr(buffer),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("always")
            warnings.showwarning = show
            parser = Parser(prog="sglang serve")
            server_args.add_cli_args(parser)
            if not answer["options"]:
                answer["options"] = sorted(parser._option_string_actions)
            for _ in range(MAX_PASSES):
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
    lines = dict.fromkeys(ANSI.sub("", buffer.getvalue()).strip().splitlines())
    return {"errors": errors, "output": "\n".join(lines)}


def env_findings(package_dir: Path, names: list[str]) -> dict[str, Any]:
    """Which spellings of each variable occur in SGLang's source, and SGLang's own
    deprecation message for it."""
    spellings = {n: [n] + (["SGLANG_" + n[4:]] if n.startswith("SGL_") else []) for n in names}
    wanted = {s.encode() for forms in spellings.values() for s in forms}
    found: set[bytes] = set()
    for path in package_dir.rglob("*.py"):
        data = path.read_bytes()
        found |= {w for w in wanted - found if w in data}
        if found == wanted:
            break
    try:
        from sglang.srt.environ import _DEPRECATED_ENVS as deprecated
    except Exception:
        deprecated = {}
    findings: dict[str, Any] = {}
    for name in names:
        entry, note = deprecated.get(name), None
        if entry is not None:
            note = f"Environment variable {name} is deprecated."
            if getattr(entry, "replacement", None):
                note += f" Please use {entry.replacement} instead."
            if getattr(entry, "note", None):
                note += f" {entry.note}"
        findings[name] = {
            "read_as": [s for s in spellings[name] if s.encode() in found],
            "deprecated": note,
        }
    return findings


def main(marker: str, real_stdout: TextIO) -> None:
    # Run by path, Python put this file's directory first on sys.path: nothing in it may
    # shadow a module SGLang imports.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    request = json.load(sys.stdin)
    answer: dict[str, Any] = {
        "python": sys.version.split()[0],
        "version": None,
        "import_error": None,
        "options": [],
        "results": [],
        "env": {},
    }

    def emit() -> None:
        real_stdout.write(marker + json.dumps(answer) + "\n")
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
        return
    if answer["version"] is None:
        answer["version"] = getattr(sglang, "__version__", None)
    for item in request["requests"]:
        answer["results"].append(parse_one(ServerArgs, item, answer))
    if request["env_names"]:
        answer["env"] = env_findings(Path(sglang.__file__).parent, request["env_names"])
    emit()


if __name__ == "__main__":
    # SGLang prints on import; only the marked answer line goes to the real stdout.
    out, sys.stdout = sys.stdout, sys.stderr
    main(sys.argv[1], out)
