"""`kimi-serve reexec`: ask the running daemon to hand over to a fresh exec of the installed
kimi-serve under the same PID (docs/architecture.md, "Hand-over"). SGLang keeps serving; the
answer (202) comes before the exec. Sent as `restart` is (cli.commands.cmd_operation: POST /reexec
with the admin token), with the same options and exit codes (control_commands)."""

from __future__ import annotations

WHAT = (
    "hand the daemon over to a fresh exec of the installed kimi-serve (same PID); SGLang keeps "
    "serving, not restarted"
)
TIMEOUT_S = 10.0
