"""`kimi-serve reexec`: ask the running daemon to hand over to a fresh exec of the installed
kimi-serve under the same PID (docs/architecture.md, "Hand-over"). SGLang keeps serving; the
answer (202) comes before the exec. Exit codes as for `restart` (control_commands)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

WHAT = (
    "hand the daemon over to a fresh exec of the installed kimi-serve (same PID); SGLang keeps "
    "serving, not restarted"
)
TIMEOUT_S = 10.0


def register(
    add: Callable[[str, Callable[..., int], str], argparse.ArgumentParser],
    func: Callable[..., int],
    token_help: str,
) -> None:
    """The subcommand, sent like `restart` (cli.cmd_operation: POST /reexec with the token)."""
    p = add("reexec", func, WHAT)
    p.add_argument("--url", metavar="URL", help="admin base URL (default from admin.listen)")
    p.add_argument("--token-file", metavar="FILE", help=token_help)
    p.add_argument(
        "--timeout",
        type=float,
        default=TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long to wait for the answer (default {TIMEOUT_S:g})",
    )
