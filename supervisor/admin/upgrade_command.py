"""`kimi-serve upgrade status|accept|rollback [--json] [--yes]`: where the launch stands against
the last known good (`/status.upgrade`), and the operator's two decisions about a trial
(POST /upgrade/accept, /upgrade/rollback; docs/quality.md, "Trials and the last known good").

- `status`: the trial, the last known good, why; `--json` the `/status.upgrade` document.
- `accept`: the trial (or, after a rollback or a hold, the config launched again) becomes the
  last known good. `rollback`: the last known good is relaunched now. Both show what they would
  do and ask for confirmation, `--yes` for scripts (without a terminal and without `--yes` they
  refuse: nothing is changed by a pipe's accident).

Exit codes: 0 done, 1 refused (the daemon's reason printed) or not confirmed, 4 unreachable,
5 the admin address held by another user's socket, 77 the token unreadable or rejected, 78 bad
config.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from supervisor import secret_files, terminal
from supervisor.admin import client as adminclient
from supervisor.exits import EX_DONE, EX_NOPERM, EX_NOT_SERVICE, EX_REFUSED, EX_UNREACHABLE

ACTIONS = ("status", "accept", "rollback")
WHAT = (
    "trials and the last known good: status, accept the trial (it becomes the last known "
    "good), or roll back to the last known good now"
)
EPILOG = (
    "exit status: 0 done, 1 refused or not confirmed, 4 unreachable, 5 the admin address held "
    "by another user, 77 token unreadable or rejected, 78 bad config"
)
DOES = {
    "accept": "take the launch as the last known good of its profile (after a rollback or a "
    "hold: relaunch the config and take it once ready)",
    "rollback": "stop the trial and relaunch the last known good (a full model load)",
}


def arguments(p: argparse.ArgumentParser, token_help: str) -> None:
    p.epilog = EPILOG
    p.add_argument("action", choices=ACTIONS, help="status, accept or rollback")
    p.add_argument("--url", metavar="URL", help="admin base URL (default from admin.listen)")
    p.add_argument("--token-file", metavar="FILE", help=token_help)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def _fail(code: int, message: str, as_json: bool, out: TextIO, err: TextIO) -> int:
    print(f"kimi-serve upgrade: {message}", file=err)
    if as_json:
        print(json.dumps({"error": message, "exit": code}), file=out)
    return code


def _num(value: object, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) else "-"


def render(up: dict[str, Any]) -> list[str]:
    """/status.upgrade in the style of `kimi-serve status`."""
    up = terminal.sanitized(up)
    state = str(up.get("state", "none"))
    lines = [f"● upgrade: {state}" + (f" - {up['why']}" if up.get("why") else "")]
    if up.get("serving_lkg"):
        lines.append("    ROLLED BACK: the host serves the last known good, not its config")
    trial = up.get("trial")
    if isinstance(trial, dict):
        lines.append(
            f"    Trial: launch {trial.get('launch')}, served {_num(trial.get('served_s'), '.0f')}"
            f" of {_num(trial.get('period_s'), 'g')} s; gate "
            f"{_num(trial.get('decode_tokens_per_second'), '.1f')} tokens/s, accept length "
            f"{_num(trial.get('accept_length'), '.2f')}; verdict {trial.get('verdict') or '-'}"
        )
    lkg = up.get("lkg")
    if isinstance(lkg, dict):
        lines.append(
            f"    Last known good: SGLang {lkg.get('sglang_version')} ({lkg.get('python')}), "
            f"model {lkg.get('model_path')} [{lkg.get('identity')}], launch {lkg.get('launch')}"
        )
        lines.append(
            f"      gate {_num(lkg.get('decode_tokens_per_second'), '.1f')} tokens/s, accept "
            f"length {_num(lkg.get('accept_length'), '.2f')}; {lkg.get('how')}"
        )
    else:
        lines.append("    Last known good: none yet for this profile")
    if up.get("rollback_refused"):
        lines.append(f"    Rollback impossible: {up['rollback_refused']}")
    lines.append(f"    On regression: {up.get('on_trial_regression')}")
    return lines


def run(
    args: argparse.Namespace, base: str, token_file: str, stdin: TextIO, out: TextIO, err: TextIO
) -> int:
    as_json = bool(args.json)
    try:
        token = secret_files.read_for_client(token_file)
    except secret_files.TokenFileError as exc:
        return _fail(EX_NOPERM, exc.message, as_json, out, err)
    trusted = secret_files.service_uids(token_file)

    def call(method: str, path: str) -> tuple[int, dict[str, Any]]:
        r = adminclient.request(method, base, path, trusted=trusted, token=token, timeout=10.0)
        if r.status == 401:
            raise PermissionError(f"the daemon rejected the token in {token_file}")
        try:
            doc = r.json()
        except ValueError:
            doc = {"error": r.text.strip()[:200]}
        return r.status, doc if isinstance(doc, dict) else {"answer": doc}

    try:
        status, doc = call("GET", "/status")
        up = doc.get("upgrade")
        if status != 200 or not isinstance(up, dict):
            return _fail(EX_REFUSED, "this daemon reports no upgrade state", as_json, out, err)
        if args.action == "status":
            if as_json:
                print(json.dumps(up, default=str), file=out)
            else:
                print("\n".join(render(up)), file=out)
            return EX_DONE
        if not args.yes:
            for line in render(up):
                print(line, file=err)
            print(f"kimi-serve upgrade {args.action}: {DOES[args.action]}", file=err)
            if not stdin.isatty():
                return _fail(
                    EX_REFUSED, "not confirmed (no terminal: pass --yes)", as_json, out, err
                )
            print("Go ahead? [y/N] ", end="", file=err, flush=True)
            if stdin.readline().strip().lower() not in ("y", "yes"):
                return _fail(EX_REFUSED, "not confirmed", as_json, out, err)
        status, answer = call("POST", f"/upgrade/{args.action}")
    except adminclient.NotTheService as exc:
        return _fail(EX_NOT_SERVICE, str(exc), as_json, out, err)
    except adminclient.Unreachable as exc:
        message = f"cannot reach the daemon at {base} ({exc}); is it running?"
        return _fail(EX_UNREACHABLE, message, as_json, out, err)
    except PermissionError as exc:
        return _fail(EX_NOPERM, str(exc), as_json, out, err)
    if status >= 300 or answer.get("accepted") is False:
        message = f"HTTP {status}: {answer.get('error') or 'refused'}"
        return _fail(EX_REFUSED, message, as_json, out, err)
    if as_json:
        print(json.dumps(answer, default=str), file=out)
    else:
        print(
            f"upgrade {args.action} accepted; follow it with `kimi-serve upgrade status`",
            file=out,
        )
    return EX_DONE
