"""`kimi-serve restart`, `drain`, `undrain`: the operator's mutating requests to a running
daemon's admin endpoint, authenticated with the token of `admin.token_file`.

Exit codes (README.md, CLI table): 0 done (or, for restart, accepted), 1 the daemon refused,
does not support or failed the operation, 4 the daemon is unreachable, 5 the admin address is
held by another user's socket (nothing sent: admin.client), 77 (EX_NOPERM) the token file
cannot be read or the daemon rejected the token. With `--wait` (restart, undrain, reexec) the
wait's own statuses follow an accepted request (supervisor/admin/wait.py: 0, 6, 7, 8, 1, 3, 4).
`--json` prints the daemon's answer as JSON (with the wait's outcome under `wait`); the exit
codes are the same.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any, TextIO

from supervisor import secret_files, terminal
from supervisor.admin import client as adminclient
from supervisor.admin import reexec_command
from supervisor.admin import wait as waiting
from supervisor.admin.status_command import router_lines
from supervisor.config.convert import parse_duration
from supervisor.exits import EX_DONE, EX_NOPERM, EX_NOT_SERVICE, EX_REFUSED, EX_UNREACHABLE

WHAT = {
    "restart": "restart SGLang (reason manual); the relaunch takes as long as a model load",
    "drain": "deregister from the router and wait for in-flight requests; SGLang keeps running",
    "undrain": "register with the router again after a drain",
    "reexec": reexec_command.WHAT,
}


def read_token(path: str, command: str, err: TextIO) -> str | None:
    try:
        return secret_files.read_for_client(path)
    except secret_files.TokenFileError as exc:
        print(f"kimi-serve {command}: {exc.message}", file=err)
        return None


# How long each request waits for the daemon's answer by default (drain: the drain itself).
ANSWER_TIMEOUT = {
    "restart": 10.0,
    "drain": 600.0,
    "undrain": 30.0,
    "reexec": reexec_command.TIMEOUT_S,
}

# With --wait --timeout: how far past the wait's end a request may still be read (a wait ends
# within this of --timeout, whatever the endpoint does).
GRACE_S = 0.5

EPILOG = {
    "restart": "exit status: 0 accepted (with --wait: ready on the primary profile), 1 refused "
    "(with --wait: failed, the reason and incident printed), 4 unreachable, 5 the admin address "
    "held by another user, 77 token unreadable or rejected, 78 bad config; with --wait also "
    "6 ready on the fallback profile, 7 ready on the rolled-back last known good, 3 not ready "
    "when --timeout ran out",
    "drain": "exit status: 0 drained, 1 refused, failed or not supported, 4 unreachable, 5 the "
    "admin address held by another user, 77 token unreadable or rejected, 78 bad config",
    "undrain": "exit status: 0 undrained, or nothing to do (serving, not draining; with --wait: "
    "ready and registered), 1 refused (loading, failed) or "
    "failed, 3 not ready when --timeout ran out, 4 unreachable, 5 the admin address held by "
    "another user, 77 token unreadable or rejected, 78 bad config; with --wait also 6 ready "
    "on the fallback profile, 7 on the rolled-back last known good",
    "reexec": "exit status: 0 accepted (with --wait: handed over and ready), 1 refused (not "
    "serving; with --wait also: the hand-over failed, no exec, or the daemon failed, the reason "
    "printed), 4 unreachable, 5 the admin address held by another user, 77 token unreadable or "
    "rejected, 78 bad config; with --wait also 8 ready, but the hand-over fell back to a "
    "restart (the reason printed), 6 ready on the fallback profile, 7 on the rolled-back last "
    "known good, 3 not ready when --timeout ran out",
}
TOKEN_HELP = "admin token file (default admin.token_file of the config)"
WAIT_HELP = {
    "restart": "wait until the new launch is ready, showing its progress",
    "undrain": "wait until the new launch is ready and registered with the router, showing "
    "its progress",
    "reexec": "wait until the new program has adopted SGLang and is ready (or the hand-over "
    "fell back or failed), showing its progress",
    # Accepted so that scripts may pass --wait to every operation: a drain's answer is already
    # its end (out of the router's list, SGLang idle or router.drain_timeout).
    "drain": "accepted, changes nothing: drain always answers once the router no longer lists "
    "this host and SGLang is idle (or router.drain_timeout ran out)",
}
# The operations whose --wait follows /status afterwards (drain's answer is its end).
FOLLOWED = frozenset({"restart", "undrain", "reexec"})


def arguments(p: argparse.ArgumentParser, name: str) -> None:
    """The options of `restart`, `drain`, `undrain`, `reexec` (cli.build_parser)."""
    timeout = ANSWER_TIMEOUT[name]
    p.epilog = EPILOG[name]
    p.add_argument("--url", metavar="URL", help="admin base URL (default from admin.listen)")
    p.add_argument("--token-file", metavar="FILE", help=TOKEN_HELP)
    p.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    if name in WAIT_HELP:
        p.add_argument("--wait", action="store_true", help=WAIT_HELP[name])
    p.add_argument(
        "--timeout",
        type=duration,
        metavar="D",
        help=f"how long to wait for the answer (default {timeout:g} s); with --wait, for "
        "the whole wait (default twice readiness.load_timeout). 30s, 15m, 1h or seconds"
        if name in FOLLOWED
        else f"how long to wait for the answer (default {timeout:g} s). 30s, 15m or seconds",
    )


def duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class Request:
    """One mutating command as the operator asked for it."""

    command: str
    base: str
    token_file: str
    timeout: float | None  # the answer's read timeout; with `wait` the whole wait's bound
    answer_timeout: float
    as_json: bool = False
    wait: bool = False


def request_of(args: argparse.Namespace, base: str, token_file: str) -> Request:
    """The request the command line asks for (`arguments`' options)."""
    wait = bool(getattr(args, "wait", False)) and args.command in FOLLOWED
    answer = ANSWER_TIMEOUT[args.command]
    timeout = args.timeout if args.timeout is not None else (None if wait else answer)
    return Request(args.command, base, token_file, timeout, answer, as_json=args.json, wait=wait)


def run(req: Request, out: TextIO, err: TextIO) -> int:
    command, base, token_file = req.command, req.base, req.token_file

    def fail(code: int, message: str) -> int:
        print(f"kimi-serve {command}: {message}", file=err)
        if req.as_json:
            print(json.dumps({"error": message, "exit": code}), file=out)
        return code

    token = read_token(token_file, command, err)
    if token is None:
        if req.as_json:
            print(
                json.dumps({"error": "the admin token file cannot be read", "exit": EX_NOPERM}),
                file=out,
            )
        return EX_NOPERM
    trusted = secret_files.service_uids(token_file)
    started, sent_at = time.monotonic(), time.time()

    def within_wait(default: float) -> float:
        """A request's whole deadline: `default`, and with --wait --timeout never past the
        wait's end (by more than GRACE_S: the last answer is still read)."""
        if not req.wait or req.timeout is None:
            return default
        left = req.timeout - (time.monotonic() - started)
        return max(GRACE_S, min(default, left + GRACE_S))

    answer = req.answer_timeout if req.wait else req.timeout
    try:
        r = adminclient.request(
            "POST",
            base,
            f"/{command}",
            trusted=trusted,
            token=token,
            timeout=5.0,
            read_timeout=answer,
            deadline=within_wait(5.0 + (answer or 5.0)),
        )
    except adminclient.NotTheService as exc:
        return fail(EX_NOT_SERVICE, str(exc))
    except adminclient.Unreachable as exc:
        return fail(
            EX_UNREACHABLE,
            f"cannot reach the daemon at {base} ({exc}); is it running? "
            "(systemctl status kimi-serve)",
        )
    if r.status == 401:
        return fail(
            EX_NOPERM,
            f"the daemon rejected the token in {token_file} "
            "(another daemon on this port, or a config with another admin.token_file?)",
        )
    try:
        doc = r.json()
    except ValueError:
        doc = {"error": r.text.strip()[:200]}
    if not isinstance(doc, dict):
        doc = {"answer": doc}
    if r.status >= 300 or doc.get("accepted") is False:
        return fail(EX_REFUSED, f"HTTP {r.status}: {doc.get('error') or r.reason}")
    if not req.wait:
        if req.as_json:
            print(json.dumps(doc, default=str), file=out)
        else:
            print(render_answer(command, r.status, doc), file=out)
        return EX_DONE
    if not req.as_json:
        print(render_answer(command, r.status, doc), file=out)

    def status() -> dict[str, Any]:
        # Across a hand-over the new program answers on the inherited socket once it has
        # started (seconds, the interpreter's imports): a slow answer, never a refused one.
        read_timeout = None
        if command == "reexec":
            spent = time.monotonic() - started
            left_s = reexec_command.POLL_READ_S if req.timeout is None else req.timeout - spent
            read_timeout = min(reexec_command.POLL_READ_S, max(1.0, left_s))
        per_read = 5.0 if read_timeout is None else read_timeout
        try:
            a = adminclient.request(
                "GET",
                base,
                "/status",
                trusted=trusted,
                token=token,
                read_timeout=read_timeout,
                deadline=within_wait(5.0 + per_read),
            )
            got = a.json() if a.status == 200 else None
        except (adminclient.NotTheService, ValueError) as exc:
            # Another user's socket took the port meanwhile, or the answer is not JSON: no
            # status to trust, so as good as unreachable.
            raise adminclient.Unreachable(str(exc)) from None
        if not isinstance(got, dict):
            raise adminclient.Unreachable(f"/status answered HTTP {a.status}")
        return got

    launch = doc.get("launch")
    goal = waiting.Goal(
        launch=launch if isinstance(launch, int) else 0,
        registered=command == "undrain",
        sent_at=sent_at,
    )
    if command == "reexec":
        goal = reexec_command.goal(doc, sent_at)
    left = None if req.timeout is None else max(0.0, req.timeout - (time.monotonic() - started))
    last: dict[str, Any] = {}

    def get() -> dict[str, Any]:
        nonlocal last
        last = status()
        return last

    outcome = waiting.follow(get, goal, left, err)
    if req.as_json:
        wait_doc = {"exit": outcome.code, "outcome": outcome.message, "status": last}
        print(json.dumps({**doc, "wait": wait_doc}, default=str), file=out)
    else:
        stream = out if outcome.code == EX_DONE else err
        print(f"kimi-serve {command}: {outcome.message}", file=stream)
    return outcome.code


def render_answer(command: str, http_status: int, doc: dict[str, Any]) -> str:
    """The daemon's answer in the style of `kimi-serve status`."""
    doc = terminal.sanitized(doc)
    if command == "reexec":
        return (
            "reexec accepted: the daemon hands over to a fresh exec of the installed kimi-serve "
            "(same PID); SGLang keeps serving. Follow it with `kimi-serve status` (Daemon: line)"
        )
    if command == "restart":
        launch = doc.get("launch")
        which = f"launch {launch}" if isinstance(launch, int) else "a new launch"
        return (
            f"restart accepted: {which} on the primary profile (reason manual); "
            "follow it with `kimi-serve status --watch` (it asks nothing of the daemon)"
        )
    if command == "undrain" and doc.get("already"):
        lines = [f"● undrain: nothing to do: {doc['already']}"]
    else:
        lines = [f"● {command} {'accepted' if http_status == 202 else 'done'}"]
    router = doc.get("router")
    if isinstance(router, dict) and router.get("url"):
        lines.extend(router_lines(router, time.time()))
    elif doc.get("note"):
        lines.append(f"    Router: {doc['note']}")
    drain = doc.get("drain")
    if isinstance(drain, dict):
        waited = drain.get("waited_s")
        waited_s = f"{waited:.1f} s" if isinstance(waited, int | float) else "-"
        counts = f"{drain.get('running')} running, {drain.get('queued')} queued"
        if drain.get("idle"):
            lines.append(f" In flight: none (idle after {waited_s})")
        else:
            lines.append(f" In flight: NOT IDLE after {waited_s} ({counts})")
        if drain.get("error"):
            lines.append(f"            {drain['error']}")
    if doc.get("waited_for"):
        lines.append(f"Waited for: {doc['waited_for']}")
    if command == "drain":
        lines.append("      Next: `kimi-serve undrain` (or a restart) puts it back")
    return "\n".join(lines)
