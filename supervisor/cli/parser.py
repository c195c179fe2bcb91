"""`kimi-serve`'s argument parser: every command, its options, its --help and exit statuses.

Shell completion is generated from it (`python -m supervisor.completion`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from supervisor import __version__
from supervisor import config as config_mod
from supervisor.cli.commands import (
    cmd_canary,
    cmd_check,
    cmd_demo,
    cmd_gpu_clean,
    cmd_incidents,
    cmd_operation,
    cmd_preflight,
    cmd_print_command,
    cmd_probe,
    cmd_run,
    cmd_status,
    cmd_upgrade,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's own exit code is 2; a usage error is a usage error, keep that.
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


# `status` has its own (0 ready, 3 not ready, 4 unreachable, also when the port is held by
# another user; 77 a token file it may read but cannot use): see
# supervisor/admin/status_command.py; `restart`, `drain`, `undrain`, `reexec` theirs (0,
# 1 refused, 4 unreachable, 5 the port held by another user, 77 no permission; with --wait
# those of supervisor/admin/wait.py): supervisor/admin/control_commands.py. Every command's
# --help ends with its own (EXITS below).
#
# Each command's exit statuses, the epilog of its --help (README's CLI table says the same;
# restart, drain, undrain and reexec: control_commands.EPILOG).
EXITS = {
    "run": "exit status: 0 after a clean stop, 78 bad config (or unsafe token file), 1 other fatal",
    "check": "exit status: 0 valid, 78 invalid (every error printed)",
    "preflight": "exit status: 0 host ready, 1 host not ready, 78 bad config",
    "print-command": "exit status: 0, 78 bad config or unknown profile",
    "probe": "exit status: 0 probe ok, 1 probe failed, 78 bad config",
    "gpu-clean": "exit status: 0 clean, 1 leftovers that could not be removed, 78 bad config",
    "status": "exit status: 0 ready (or degraded), 3 not ready, 4 unreachable (also: the admin "
    "address held by another user), 77 the token file is not a usable token file, 78 bad config; "
    "with --watch: 0 serving on primary, 6 on the fallback profile, 7 on the rolled-back last "
    "known good, 1 failed or stopping, 3 not serving when --timeout ran out, 4 unreachable",
    "incidents": "exit status: 0, 1 unknown or ambiguous ID, 2 show without an ID, 78 bad config",
    "canary": "exit status: 0, 1 nothing to show or accept, 78 bad config",
    "demo": "exit status: 0 on Ctrl-C or after --duration",
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kimi-serve",
        description="Keeps an SGLang server actually serving: launches it, reports ready only "
        "after a real decode, restarts it on death, hangs and fatal log lines.",
    )
    parser.add_argument("--version", action="version", version=f"kimi-serve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    config_help = (
        f"config file (default ${config_mod.CONFIG_ENV}, else {config_mod.DEFAULT_CONFIG_PATH})"
    )
    from supervisor.admin import control_commands as control

    token_help = control.TOKEN_HELP

    def add(name: str, func: Callable[..., int], help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=EXITS.get(name))
        p.set_defaults(func=func)
        if name != "demo":
            p.add_argument("--config", metavar="FILE", help=config_help)
        return p

    add("run", cmd_run, "run the daemon: own SGLang until SIGTERM/SIGINT")
    p = add("check", cmd_check, "validate the config file; print ok or every error")
    p.add_argument("--json", action="store_true", help="print {ok, config, errors, warnings}")
    p = add(
        "preflight",
        cmd_preflight,
        "host checks before a long load: paths, GPUs, port, interpreter, SGLang's own parser",
    )
    p.add_argument("--json", action="store_true", help="print the checks as one JSON document")
    p = add("print-command", cmd_print_command, "print the exact SGLang command line and env")
    p.add_argument("--profile", metavar="NAME", help="profile to apply (default primary)")
    p = add("probe", cmd_probe, "send one readiness decode probe to a running server")
    p.add_argument("--url", metavar="URL", help="server base URL (default from the config)")
    p = add("gpu-clean", cmd_gpu_clean, "find and remove leftover GPU processes per policy")
    p.add_argument("--dry-run", action="store_true", help="report only; kill nothing")
    p = add("status", cmd_status, "ask a running daemon for its state")
    p.add_argument("--json", action="store_true", help="print the /status JSON document")
    p.add_argument(
        "--watch",
        action="store_true",
        help="follow the current launch until it serves or the daemon gives up, asking "
        "nothing of the daemon (exit statuses as restart --wait's)",
    )
    p.add_argument(
        "--timeout",
        type=control.duration,
        metavar="D",
        help="with --watch, how long to follow (default twice readiness.load_timeout). "
        "30s, 15m, 1h or seconds",
    )
    p.add_argument("--url", metavar="URL", help="admin base URL (default from admin.listen)")
    p.add_argument("--token-file", metavar="FILE", help=token_help)
    for name in control.ANSWER_TIMEOUT:
        control.arguments(add(name, cmd_operation, control.WHAT[name]), name)
    from supervisor.admin import upgrade_command

    p = add("upgrade", cmd_upgrade, upgrade_command.WHAT)
    upgrade_command.arguments(p, token_help)
    p = add(
        "incidents",
        cmd_incidents,
        "list the incident directories (newest first), or `show ID` for one",
    )
    p.add_argument("action", nargs="?", choices=["show"], help="show one incident")
    p.add_argument("id", nargs="?", metavar="ID", help="incident id, unique prefix, or last")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = add(
        "canary",
        cmd_canary,
        "the canary's golden answers: show them, accept the last answer, or forget them; "
        "try: what the running model answers to the known answers",
    )
    from supervisor.quality import canary_cli

    canary_cli.arguments(p)
    p = add("demo", cmd_demo, "run the real supervisor against the bundled SGLang stand-in")
    p.add_argument("--fault", metavar="NAME", help="replay a fault, e.g. seed-incident")
    p.add_argument("--load-seconds", type=float, default=3.0, help="stand-in load time")
    p.add_argument("--duration", type=float, metavar="SECONDS", help="stop by itself after SECONDS")
    return parser
