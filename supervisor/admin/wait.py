"""`restart --wait` and `undrain --wait`: follow the daemon's /status until the launch asked
for serves, and say how it ended.

The restart's accept answer names the launch it makes (`launch`): the wait is for that one (or
a later one, after a crash on the way), never for the old launch that is still `ready` for the
moment between the request and the daemon taking it. Decide, then do: `verdict` and
`progress_line` are pure (a /status document in, an outcome or a line out); `follow` polls.

Exit statuses (README.md, CLI table; supervisor/exits.py):
- 0: ready (or degraded) on the configured profile, `primary`;
- 6: ready, but on the fallback profile (`restart.fallback_profile` after a crash loop);
- 7: ready, but on the rolled-back last known good (`/status.upgrade.state` `rolled_back`);
- 8: ready, but the hand-over fell back to an ordinary restart (`reexec --wait`);
- 1: the daemon gave up (`failed`) or is stopping: the reason and the incident are printed;
- 3: still not ready when the wait's timeout ran out;
- 4: the daemon could no longer be reached.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from supervisor.admin import client as adminclient
from supervisor.admin.status_command import load_progress
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
    with the router where one is configured (`registered`), and whether a hand-over's
    fallback to a restart is to be reported (`handover`)."""

    launch: int = 0
    registered: bool = False
    handover: bool = False
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


def _handover_fell_back(doc: dict[str, Any]) -> bool:
    daemon = doc.get("daemon")
    last = daemon.get("last_handoff") if isinstance(daemon, dict) else None
    outcome = str(last.get("outcome", "")) if isinstance(last, dict) else ""
    return "restart" in outcome or "fell" in outcome or "fallback" in outcome


def verdict(doc: dict[str, Any], goal: Goal, fresh: bool) -> Outcome | None:
    """How the wait ends on this /status, or None to keep waiting. `fresh`: the document
    may show the outcome of this request (the daemon has been seen past it: a launch of
    the goal's number, or another state than the one the request found)."""
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
        if goal.handover and _handover_fell_back(doc):
            return Outcome(
                EX_READY_RESTARTED, f"{state}, but the hand-over fell back to a restart ({where})"
            )
        return Outcome(EX_OK, f"{state} ({where})")
    if fresh and state in ("failed", "stopping", "stopped"):
        why = doc.get("detail") or (doc.get("last_restart") or {}).get("reason") or "no reason"
        incident = _incident(doc)
        tail = f"; incident {incident} (kimi-serve incidents show {incident})" if incident else ""
        return Outcome(EX_FAIL, f"{state}: {why}{tail}")
    return None


def progress_line(doc: dict[str, Any], waited_s: float) -> str:
    """One line: state, launch, load phase, elapsed against load_timeout, restarts, waited."""
    state = str(doc.get("state", "?"))
    parts = [f"{state} (launch {_launch(doc)}, {doc.get('profile')})"]
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
    return (doc.get("state"), _launch(doc), phase, str(doc.get("restarts")))


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
) -> Outcome:
    """Poll `get()` (/status) every second until `verdict` ends the wait or `timeout` runs
    out (None: `default_timeout` of the first answer). Progress goes to `progress`: one line
    rewritten in place on a terminal, one line per change of state, launch, phase or
    restarts otherwise."""
    start = clock()
    tty = progress.isatty()
    first: tuple[Any, ...] | None = None
    bound = 0.0
    fresh = False
    shown: tuple[Any, ...] | None = None
    doc: dict[str, Any] = {}
    try:
        while True:
            try:
                doc = get()
            except adminclient.Unreachable as exc:
                return Outcome(EX_UNREACHABLE, f"the daemon could not be reached ({exc})")
            key = _phase_key(doc)
            if first is None:
                first = key
                bound = default_timeout(doc) if timeout is None else timeout
            since = doc.get("since")
            entered = isinstance(since, int | float) and since >= goal.sent_at > 0
            fresh = fresh or entered or key[:2] != first[:2] or _launch(doc) >= goal.launch > 0
            waited = clock() - start
            line = progress_line(doc, waited)
            if tty:
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
                    EX_NOT_READY, f"not ready after {bound:.0f} s: {progress_line(doc, waited)}"
                )
            sleep(min(POLL_S, max(0.0, bound - waited)))
    finally:
        if tty and shown is not None:
            progress.write("\n")
            progress.flush()
