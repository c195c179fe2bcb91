"""`restart --wait`, `undrain --wait` and `reexec --wait`: follow the daemon's /status until
the launch asked for serves, and say how it ended.

The restart's accept answer names the launch it makes (`launch`): the wait is for that one (or
a later one, after a crash on the way), never for the old launch that is still `ready` for the
moment between the request and the daemon taking it. The hand-over's answer gives the daemon's
`handoffs` and `last_handoff` as they were: the wait is for a `last_handoff` other than that
one (the new program writes it once SGLang answered its first decode, or fell back; the old one
when the exec did not happen), then for serving. Decide, then do: `verdict` and
`progress_line` are pure (a /status document in, an outcome or a line out); `follow` polls.

Exit statuses (README.md, CLI table; supervisor/exits.py):
- 0: ready (or degraded) on the configured profile, `primary`;
- 6: ready, but on the fallback profile (`restart.fallback_profile` after a crash loop);
- 7: ready, but on the rolled-back last known good (`/status.upgrade.state` `rolled_back`);
- 8: ready, but the hand-over fell back to an ordinary restart (`reexec --wait`): its why;
- 1: the daemon gave up (`failed`) or is stopping: the reason and the incident are printed;
  the hand-over failed (no exec: the old program goes on): its why;
- 3: still not ready when the wait's timeout ran out;
- 4: the daemon could no longer be reached.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from supervisor import terminal
from supervisor.admin import client as adminclient
from supervisor.admin import status_command
from supervisor.admin.status_command import hand_overs, load_progress
from supervisor.exits import (
    EX_FAIL,
    EX_NOT_READY,
    EX_OK,
    EX_READY_FALLBACK,
    EX_READY_RESTARTED,
    EX_READY_ROLLED_BACK,
    EX_UNREACHABLE,
)

PRIMARY = "primary"
# Serving, in the exit statuses of a wait (0 is EX_OK).
READY_CODES = (EX_OK, EX_READY_FALLBACK, EX_READY_ROLLED_BACK, EX_READY_RESTARTED)
SERVING = ("ready", "degraded")
POLL_S = 1.0
# Without --timeout: a whole load and a relaunch after it.
DEFAULT_LOAD_TIMEOUTS = 2
# When /status does not say the load_timeout (an older daemon, or no load under way yet).
FALLBACK_LOAD_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Outcome:
    code: int
    message: str


@dataclass(frozen=True)
class Goal:
    """What the wait is for: a serving launch numbered `launch` or later (0: any), registered
    with the router where one is configured (`registered`), and, for a hand-over
    (`handover`), a `last_handoff` newer than the one the request found (`last_at`, its `at`;
    None: there was none)."""

    launch: int = 0
    registered: bool = False
    handover: bool = False
    last_at: float | None = None
    # When the request was sent (unix s): a state entered later is the request's doing, even
    # one the first poll already finds (a restart from `failed` that failed again at once).
    sent_at: float = 0.0


def _launch(doc: dict[str, Any]) -> int:
    child = doc.get("child")
    n = child.get("launch") if isinstance(child, dict) else None
    if not isinstance(n, int):
        n = doc.get("launch")
    return n if isinstance(n, int) else 0


def _incident(doc: dict[str, Any]) -> str | None:
    last = doc.get("last_restart")
    if isinstance(last, dict) and last.get("incident"):
        return str(last["incident"]).rstrip("/").rsplit("/", 1)[-1]
    return None


def new_handoff(doc: dict[str, Any], goal: Goal) -> dict[str, Any] | None:
    """The `last_handoff` this request made, or None while /status shows none newer."""
    daemon = doc.get("daemon")
    last = daemon.get("last_handoff") if isinstance(daemon, dict) else None
    if not isinstance(last, dict) or last.get("at") == goal.last_at:
        return None
    at = last.get("at")
    if goal.last_at is None and goal.sent_at > 0:
        # An older daemon's answer named no last_handoff: one from before the request is not
        # this one (the same host's clock).
        return last if isinstance(at, int | float) and at >= goal.sent_at else None
    return last


def _why(last: dict[str, Any]) -> str:
    return str(last.get("why") or "no reason given")


def _handed_over(doc: dict[str, Any], last: dict[str, Any]) -> str:
    daemon = doc.get("daemon") or {}
    took = last.get("seconds")
    took_s = f" in {took:.1f} s" if isinstance(took, int | float) else ""
    return (
        f"handed over from kimi-serve {last.get('from_version')} to {daemon.get('version')}"
        f"{took_s} (pid {daemon.get('pid')}); SGLang kept running"
    )


def verdict(doc: dict[str, Any], goal: Goal, fresh: bool) -> Outcome | None:
    """How the wait ends on this /status, or None to keep waiting. `fresh`: the document
    may show the outcome of this request (the daemon has been seen past it: a launch of
    the goal's number, or another state than the one the request found). A hand-over's
    outcome is its new `last_handoff`: until one shows, the old program still answers."""
    last = new_handoff(doc, goal) if goal.handover else None
    if goal.handover:
        if last is None:
            return None
        if last.get("outcome") == "failed":
            return Outcome(EX_FAIL, f"the hand-over failed, no exec: {_why(last)}")
        fresh = True
    state = str(doc.get("state", "?"))
    if state in SERVING and _launch(doc) >= goal.launch:
        router = doc.get("router")
        linked = router if isinstance(router, dict) and router.get("url") else None
        if goal.registered and linked is not None and not linked.get("registered"):
            return None
        profile = str(doc.get("profile"))
        upgrade = doc.get("upgrade")
        where = f"launch {_launch(doc)}, profile {profile}"
        if isinstance(upgrade, dict) and upgrade.get("state") == "rolled_back":
            return Outcome(
                EX_READY_ROLLED_BACK, f"{state} on the rolled-back last known good ({where})"
            )
        if profile != PRIMARY:
            return Outcome(EX_READY_FALLBACK, f"{state} on the fallback profile ({where})")
        if last is not None and last.get("outcome") == "fallback":
            return Outcome(
                EX_READY_RESTARTED,
                f"{state}, but the hand-over fell back to a restart: {_why(last)} ({where})",
            )
        if last is not None:
            return Outcome(EX_OK, f"{state}: {_handed_over(doc, last)} ({where})")
        return Outcome(EX_OK, f"{state} ({where})")
    if fresh and state in ("failed", "stopping", "stopped"):
        why = doc.get("detail") or (doc.get("last_restart") or {}).get("reason") or "no reason"
        incident = _incident(doc)
        tail = f"; incident {incident} (kimi-serve incidents show {incident})" if incident else ""
        return Outcome(EX_FAIL, f"{state}: {why}{tail}")
    return None


def progress_line(doc: dict[str, Any], waited_s: float, daemon: bool = False) -> str:
    """One line: state, launch, load phase, elapsed against load_timeout, restarts, waited;
    with `daemon` (a hand-over's wait) also the daemon's version and hand-overs."""
    doc = terminal.sanitized(doc)
    state = str(doc.get("state", "?"))
    parts = [f"{state} (launch {_launch(doc)}, {doc.get('profile')})"]
    d = doc.get("daemon")
    if daemon and isinstance(d, dict):
        parts.append(f"kimi-serve {d.get('version')}, {hand_overs(d.get('handoffs'))}")
    loading = doc.get("loading")
    if isinstance(loading, dict):
        parts.extend(load_progress(loading))
    elif state not in SERVING and doc.get("detail"):
        parts.append(str(doc["detail"]))
    restarts = doc.get("restarts")
    total = (
        sum(v for v in restarts.values() if isinstance(v, int)) if isinstance(restarts, dict) else 0
    )
    parts.append(f"restarts {total}")
    parts.append(f"waited {waited_s:.0f} s")
    return ", ".join(parts)


def _phase_key(doc: dict[str, Any]) -> tuple[Any, ...]:
    loading = doc.get("loading")
    phase = loading.get("phase") if isinstance(loading, dict) else None
    d = doc.get("daemon")
    handoffs = (d.get("version"), d.get("handoffs")) if isinstance(d, dict) else None
    return (doc.get("state"), _launch(doc), phase, str(doc.get("restarts")), handoffs)


def default_timeout(doc: dict[str, Any]) -> float:
    loading = doc.get("loading")
    budget = loading.get("load_timeout_s") if isinstance(loading, dict) else None
    if not isinstance(budget, int | float) or budget <= 0:
        budget = FALLBACK_LOAD_TIMEOUT_S
    return DEFAULT_LOAD_TIMEOUTS * float(budget)


Get = Callable[[], dict[str, Any]]


def follow(
    get: Get,
    goal: Goal,
    timeout: float | None,
    progress: TextIO,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    fresh: bool = False,
) -> Outcome:
    """Poll `get()` (/status) every second until `verdict` ends the wait or `timeout` runs
    out (None: `default_timeout` of the first answer). Progress goes to `progress`: one line
    rewritten in place on a terminal, one line per change of state, launch, phase or
    restarts otherwise. `fresh`: the first answer may already be the outcome (`status
    --watch`, which asked for nothing: a `failed` it finds is its end)."""
    start = clock()
    tty = progress.isatty()
    first: tuple[Any, ...] | None = None
    bound = 0.0
    shown: tuple[Any, ...] | None = None
    doc: dict[str, Any] = {}
    try:
        while True:
            try:
                doc = get()
            except adminclient.Unreachable as exc:
                if first is not None and clock() - start >= bound:
                    # The bound ran out while an answer was awaited (a slow one is no more
                    # than that: `reexec --wait` reads for up to the time left).
                    return Outcome(EX_NOT_READY, f"not ready after {bound:.0f} s: {exc}")
                return Outcome(EX_UNREACHABLE, f"the daemon could not be reached ({exc})")
            key = _phase_key(doc)
            if first is None:
                first = key
                bound = default_timeout(doc) if timeout is None else timeout
            since = doc.get("since")
            entered = isinstance(since, int | float) and since >= goal.sent_at > 0
            fresh = fresh or entered or key[:2] != first[:2] or _launch(doc) >= goal.launch > 0
            waited = clock() - start
            line = progress_line(doc, waited, goal.handover)
            redraw = getattr(progress, "redraw", None)
            if tty and callable(redraw):
                redraw(line)  # terminal.Guard: the one way to rewrite the line
            elif tty:
                progress.write(f"\r{line}\x1b[K")
                progress.flush()
            elif key != shown:
                progress.write(line + "\n")
                progress.flush()
            shown = key
            outcome = verdict(doc, goal, fresh)
            if outcome is not None:
                return outcome
            if waited >= bound:
                return Outcome(
                    EX_NOT_READY,
                    f"not ready after {bound:.0f} s: {progress_line(doc, waited, goal.handover)}",
                )
            sleep(min(POLL_S, max(0.0, bound - waited)))
    finally:
        if tty and shown is not None:
            progress.write("\n")
            progress.flush()


def watch(get: Get, timeout: float | None, progress: TextIO) -> Outcome:
    """`kimi-serve status --watch`: follow the current launch, asking nothing of the daemon,
    until it serves (0, or 6/7 on the fallback profile or the rolled-back last known good),
    the daemon gives up (1: `failed`, stopping), `timeout` runs out (3) or the daemon cannot
    be reached (4). Serving already: at once."""
    return follow(get, Goal(), timeout, progress, fresh=True)


def run_watch_command(
    base: str,
    timeout: float | None,
    as_json: bool,
    out: TextIO,
    err: TextIO,
    token: str | None = None,
    trusted: frozenset[int] | None = None,
) -> int:
    """`status --watch`: progress on stderr, the outcome on stdout (stderr when not ready);
    with `as_json`, `{"exit", "outcome", "status"}` on stdout."""
    owners = trusted if trusted is not None else frozenset({0, os.geteuid()})
    last: dict[str, Any] = {}

    def get() -> dict[str, Any]:
        nonlocal last
        try:
            r = status_command.fetch(base, owners, token)
            doc = r.json() if r.status == 200 else None
        except (adminclient.NotTheService, ValueError) as exc:
            raise adminclient.Unreachable(str(exc)) from None
        if not isinstance(doc, dict):
            raise adminclient.Unreachable(f"/status answered HTTP {r.status}")
        last = doc
        return doc

    outcome = watch(get, timeout, err)
    if as_json:
        print(
            json.dumps({"exit": outcome.code, "outcome": outcome.message, "status": last}), file=out
        )
    else:
        stream = out if outcome.code in READY_CODES else err
        print(f"kimi-serve status: {outcome.message}", file=stream)
    return outcome.code
