"""`kimi-serve restart`, `drain`, `undrain`: the operator's mutating requests to a running
daemon's admin endpoint, authenticated with the token of `admin.token_file`.

Exit codes (README.md, CLI table): 0 done (or, for restart, accepted), 1 the daemon refused,
does not support or failed the operation, 4 the daemon is unreachable, 5 the admin address is
held by another user's socket (nothing sent: adminclient), 77 (EX_NOPERM) the token file
cannot be read or the daemon rejected the token.
"""

from __future__ import annotations

import json
from typing import TextIO

from supervisor import secret_files as admin_token
from supervisor.admin import client as adminclient
from supervisor.exits import EX_DONE, EX_NOPERM, EX_NOT_SERVICE, EX_REFUSED, EX_UNREACHABLE

WHAT = {
    "restart": "restart SGLang (reason manual); the relaunch takes as long as a model load",
    "drain": "deregister from the router and wait for in-flight requests; SGLang keeps running",
    "undrain": "register with the router again after a drain",
}


def read_token(path: str, command: str, err: TextIO) -> str | None:
    try:
        return admin_token.read_for_client(path)
    except admin_token.TokenFileError as exc:
        print(f"kimi-serve {command}: {exc.message}", file=err)
        return None


def run_operation(
    command: str, base: str, token_file: str, timeout: float, out: TextIO, err: TextIO
) -> int:
    token = read_token(token_file, command, err)
    if token is None:
        return EX_NOPERM
    try:
        r = adminclient.request(
            "POST",
            base,
            f"/{command}",
            trusted=admin_token.service_uids(token_file),
            token=token,
            timeout=5.0,
            read_timeout=timeout,
        )
    except adminclient.NotTheService as exc:
        print(f"kimi-serve {command}: {exc}", file=err)
        return EX_NOT_SERVICE
    except adminclient.Unreachable as exc:
        print(
            f"kimi-serve {command}: cannot reach the daemon at {base} ({exc}); "
            "is it running? (systemctl status kimi-serve)",
            file=err,
        )
        return EX_UNREACHABLE
    if r.status == 401:
        print(
            f"kimi-serve {command}: the daemon rejected the token in {token_file} "
            "(another daemon on this port, or a config with another admin.token_file?)",
            file=err,
        )
        return EX_NOPERM
    try:
        doc = r.json()
    except ValueError:
        doc = {"error": r.text.strip()[:200]}
    if r.status >= 300 or (isinstance(doc, dict) and doc.get("accepted") is False):
        error = doc.get("error") if isinstance(doc, dict) else None
        print(f"kimi-serve {command}: HTTP {r.status}: {error or r.reason}", file=err)
        return EX_REFUSED
    verb = "accepted" if r.status == 202 else "done"
    print(f"{command} {verb}: {json.dumps(doc, default=str)}", file=out)
    return EX_DONE
