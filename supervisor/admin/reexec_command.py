"""`kimi-serve reexec`: ask the running daemon to hand over to a fresh exec of the installed
kimi-serve under the same PID (docs/architecture.md, "Hand-over"). SGLang keeps serving; the
answer (202) comes before the exec. Sent as `restart` is (cli.commands.cmd_operation: POST /reexec
with the admin token), with the same options and exit codes (control_commands).

`--wait` follows the hand-over (supervisor/admin/wait.py): the answer carries the daemon's
`last_handoff` as the request found it, and the wait ends on the next one and the host serving.
"""

from __future__ import annotations

from typing import Any

from supervisor.admin.wait import Goal

WHAT = (
    "hand the daemon over to a fresh exec of the installed kimi-serve (same PID); SGLang keeps "
    "serving, not restarted"
)
TIMEOUT_S = 10.0
# How long one poll of `--wait` reads: the new program's start at a high load took 6.5 s
# (docs/benchmarks.md, "Hand-over against a restart"); never more than the wait has left.
POLL_READ_S = 60.0


def goal(answer: dict[str, Any], sent_at: float) -> Goal:
    """The wait for the hand-over `answer` (202) accepted: a `last_handoff` other than the one
    it names. A daemon whose answer names none (an older one) is judged by the clock: a
    `last_handoff` from before the request is not this one."""
    daemon = answer.get("daemon")
    if isinstance(daemon, dict):
        last = daemon.get("last_handoff")
        at = last.get("at") if isinstance(last, dict) else None
        return Goal(handover=True, last_at=at if isinstance(at, int | float) else None)
    return Goal(handover=True, last_at=None, sent_at=sent_at)
