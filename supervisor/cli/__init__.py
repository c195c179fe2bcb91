"""`kimi-serve` command line. Exit codes follow the contract; no traceback reaches an operator.

The parser is `cli.parser` (completion is generated from it), what each command does
`cli.commands`; here the entry point, `main`, and the stdout it writes to.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TextIO, cast

from supervisor.cli.parser import build_parser as build_parser
from supervisor.exits import EX_CONFIG as EX_CONFIG
from supervisor.exits import EX_FAIL, EX_OK
from supervisor.terminal import Guard, Wrapped


class _Stdout(Wrapped):
    """stdout for a command: once the reader has gone (`kimi-serve status | head -1`), what
    is left is written to /dev/null, so the command ends quietly with the exit code it would
    have had (the state, for `status`) instead of a BrokenPipeError."""

    def write(self, s: str) -> int:
        try:
            return self._stream.write(s)
        except BrokenPipeError:
            self._to_devnull()
            return len(s)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        # The stream's buffer still holds what failed; the interpreter flushes it at exit,
        # and that flush must not fail again (exit status 120, an "Exception ignored").
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)


# The commands whose output is the daemon's own log (its renderer decides what reaches the
# terminal); every other command writes through terminal.Guard.
UNGUARDED = frozenset({"run", "demo"})


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = cast(TextIO, _Stdout(sys.stdout))
    err = sys.stderr
    saved = sys.stdout, sys.stderr
    if args.command not in UNGUARDED:
        # Whatever a command prints, from whichever source, reaches the terminal escaped.
        out, err = cast(TextIO, Guard(out)), cast(TextIO, Guard(sys.stderr))
        sys.stdout, sys.stderr = out, err
    try:
        code: int = args.func(args, out, err)
        out.flush()
    except KeyboardInterrupt:
        code = 130 if args.command != "demo" else EX_OK
    except Exception as exc:  # the last line of defence: a message, never a traceback
        print(f"kimi-serve {args.command}: internal error: {exc!r}", file=sys.stderr)
        if os.environ.get("KIMI_SERVE_DEBUG"):
            raise
        code = EX_FAIL
    finally:
        sys.stdout, sys.stderr = saved
    return code
