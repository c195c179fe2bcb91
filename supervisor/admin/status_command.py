"""`kimi-serve status`: ask the running daemon (its admin endpoint) and summarise, in the
spirit of `systemctl status`."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any, TextIO

from supervisor import terminal
from supervisor.admin import client as adminclient
from supervisor.core.states import how_it_ended
from supervisor.exits import EX_NOT_READY, EX_READY, EX_UNREACHABLE

TAIL_SHOWN = 25
# `kimi-serve status` gives up after this many seconds per request, connecting included
# (exit 4); a refused token asks once more without it, so at most twice this.
DEADLINE_S = 10.0


def _ago(unix: float | None, now: float) -> str:
    if not unix:
        return "-"
    secs = max(0.0, now - float(unix))
    if secs < 120:
        return f"{secs:.0f} s ago"
    if secs < 7200:
        return f"{secs / 60:.0f} min ago"
    return f"{secs / 3600:.1f} h ago"


def _when(unix: float | None) -> str:
    if not unix:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(unix)))


def quality_line(q: object) -> str:
    """/status.quality on one line: the canary, decode speed, accept length, degraded reasons."""
    if not isinstance(q, dict):
        return ""
    raw = q.get("canary")
    canary: dict[str, Any] = raw if isinstance(raw, dict) else {}
    state = str(canary.get("state", "?"))
    parts = [f"canary {state.upper() if state == 'mismatch' else state}"]
    if state == "mismatch":
        parts[0] += f" (expected {canary.get('expected')!r}, got {canary.get('got')!r})"
    tps = q.get("decode_tokens_per_second")
    if isinstance(tps, int | float):
        parts.append(f"decode {tps:.1f} tokens/s")
    accept = q.get("spec_accept_length")
    if isinstance(accept, int | float):
        parts.append(f"accept length {accept:.2f}")
    degraded = [str(d) for d in q.get("degraded") or []]
    parts.append("DEGRADED: " + ", ".join(degraded) if degraded else "ok")
    return ", ".join(parts)


def load_progress(loading: dict[str, Any]) -> list[str]:
    """The phase of /status.loading and its seconds against load_timeout."""
    parts = [f"phase {loading.get('phase')}"]
    elapsed, budget = loading.get("elapsed_s"), loading.get("load_timeout_s")
    if isinstance(elapsed, int | float) and isinstance(budget, int | float) and budget > 0:
        share = f"{100 * elapsed / budget:.0f}%"
        parts.append(f"{elapsed:.0f} s of load_timeout {budget:.0f} s ({share})")
    return parts


def loading_line(loading: object) -> str:
    """/status.loading on one line: launch, phase, seconds against load_timeout, phases done."""
    if not isinstance(loading, dict):
        return ""
    parts = [f"launch {loading.get('launch')}", *load_progress(loading)]
    done = loading.get("phases")
    if isinstance(done, dict) and done:
        spans = (f"{k} {v:.0f} s" for k, v in done.items() if isinstance(v, int | float))
        parts.append("done: " + ", ".join(spans))
    return ", ".join(parts)


def hand_overs(n: object) -> str:
    return f"{n} hand-over" if n == 1 else f"{n} hand-overs"


def daemon_lines(d: object, now: float) -> list[str]:
    """/status.daemon: its version, uptime (across hand-overs) and the last hand-over."""
    if not isinstance(d, dict):
        return []
    line = f"    Daemon: kimi-serve {d.get('version')}, pid {d.get('pid')}, up "
    line += _ago(d.get("started_at"), now)[:-4]
    last = d.get("last_handoff")
    if isinstance(last, dict):
        took = last.get("seconds")
        took_s = f" in {took:.1f} s" if isinstance(took, int | float) else ""
        line += (
            f"; {hand_overs(d.get('handoffs'))}, the last {last.get('outcome')}{took_s} "
            f"from {last.get('from_version')}, {_ago(last.get('at'), now)}"
        )
    return [line]


def render(doc: dict[str, Any], now: float) -> str:
    raw_last = doc.get("last_restart")
    raw_tail = raw_last.get("log_tail") if isinstance(raw_last, dict) else None
    raw_tail = raw_tail if isinstance(raw_tail, list) else []
    doc = terminal.sanitized(doc)  # an admin answer: every string in it is untrusted text
    out: list[str] = []
    state = doc.get("state", "?")
    mark = "●"
    out.append(f"{mark} kimi-serve {doc.get('version', '')} - SGLang {doc.get('sglang_version')}")
    out.append(
        f"     State: {state} since {_when(doc.get('since'))}; {_ago(doc.get('since'), now)}"
    )
    if doc.get("detail"):
        out.append(f"    Detail: {doc['detail']}")
    loading = loading_line(doc.get("loading"))
    if loading:
        out.append(f"   Loading: {loading}")
    out.append(f"   Profile: {doc.get('profile')}")
    out.extend(daemon_lines(doc.get("daemon"), now))
    child = doc.get("child")
    if child:
        out.append(
            f"    SGLang: pid {child.get('pid')}, up {_ago(child.get('started_at'), now)[:-4]}"
            f" ({len(child.get('processes') or [])} processes)"
        )
    else:
        out.append("    SGLang: not running")
    group = doc.get("group")
    if isinstance(group, dict):
        ready = "ready" if group.get("ready") else "not ready"
        out.append(
            f"     Group: {group.get('role')} (node rank {group.get('node_rank')}), "
            f"epoch {group.get('epoch') or '-'}, {ready}"
        )
        for p in group.get("peers") or []:
            seen = (
                f"epoch {p.get('epoch') or '-'}, {p.get('state')}"
                if p.get("reachable")
                else f"UNREACHABLE for {p.get('unreachable_s')} s: {p.get('error')}"
            )
            out.append(f"      peer {p.get('url')}: {seen}")
    if doc.get("reload_refused"):
        out.append(f"    Reload: REFUSED: {doc['reload_refused']}")
    out.extend(router_lines(doc.get("router"), now))
    restarts = doc.get("restarts") or {}
    total = sum(restarts.values())
    by = ", ".join(f"{k} {v}" for k, v in sorted(restarts.items()))
    out.append(f"  Restarts: {total}" + (f" ({by})" if by else ""))
    probe = doc.get("last_probe")
    if probe:
        verdict = "ok" if probe.get("ok") else f"FAILED ({probe.get('reason')})"
        lat = probe.get("latency_s")
        lat_s = f"{lat * 1000:.0f} ms" if isinstance(lat, int | float) else "-"
        out.append(
            f"Last probe: {probe.get('kind')} {verdict}, {lat_s}, "
            f"{probe.get('completion_tokens')} tokens, {_ago(probe.get('at'), now)}"
        )
        if probe.get("error"):
            out.append(f"            {probe['error']}")
    load = doc.get("last_load")
    if isinstance(load, dict) and load.get("phases"):
        total = load.get("total_s")
        head = f"{total:.0f} s" if isinstance(total, int | float) else "incomplete"
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in load["phases"].items())
        out.append(f" Last load: {head} ({parts})")
    quality = quality_line(doc.get("quality"))
    if quality:
        out.append(f"   Quality: {quality}")
    upgrade = doc.get("upgrade")
    if isinstance(upgrade, dict) and upgrade.get("state") not in (None, "none"):
        loud = "ROLLED BACK: serving the last known good, not the config; " * bool(
            upgrade.get("serving_lkg")
        )
        why = f" ({upgrade['why']})" if upgrade.get("why") else ""
        out.append(f"   Upgrade: {loud}{upgrade.get('state')}{why} (kimi-serve upgrade status)")
    intent = doc.get("intent") or {}
    for m in intent.get("mismatches") or []:
        out.append(
            f"  MISMATCH: {m.get('arg')}: configured {m.get('expected')!r}, "
            f"server runs {m.get('actual')!r}"
        )
    for g in doc.get("gpus") or []:
        procs = g.get("processes")
        n = len(procs) if isinstance(procs, list) else procs
        mib = (g.get("memory_used_bytes") or 0) / 2**20
        health = g.get("health") or {}
        unfit = ""
        if health.get("ok") is False:
            why = "; ".join(health.get("reasons") or [])
            unfit = f", NEEDS A {str(health.get('action', '?')).upper()}: {why}"
        out.append(
            f"     GPU {g.get('index')}: {g.get('uuid')} {mib:.0f} MiB used, {n} processes{unfit}"
        )
    killed = (doc.get("leftovers") or {}).get("killed") or {}
    if any(killed.values()):
        # Leftovers of an earlier launch removed before the last one (a crash left them).
        per = ", ".join(
            f"GPU {g}: {n}" if g != "none" else f"no GPU memory: {n}" for g, n in killed.items()
        )
        out.append(f" Leftovers: {sum(killed.values())} killed before the last launch ({per})")
    last = doc.get("last_restart")
    if last:
        how = []
        if last.get("exit_code") is not None:
            how.append(f"exit code {last['exit_code']}")
        if last.get("signal"):
            how.append(f"signal {last['signal']}")
        out.append("")
        out.append(
            f"Last restart: {last.get('reason')} {_ago(last.get('at'), now)}"
            + how_it_ended(last.get("reason"), how)
        )
        if last.get("detail"):
            out.append(f"  {last['detail']}")
        if last.get("incident"):
            name = str(last["incident"]).rstrip("/").rsplit("/", 1)[-1]
            out.append(f"  Incident: {last['incident']}")
            out.append(f"    kimi-serve incidents show {name}")
        tail = last.get("log_tail") or []
        if "log_tail" in (doc.get("redacted") or []) and not tail:
            out.append("  (SGLang's last lines are shown with the admin token: run as root or")
            out.append("   the service user, who can read admin.token_file)")
        if tail:
            out.append(f"  Last {min(len(tail), TAIL_SHOWN)} lines SGLang printed:")
            out.extend(f"    {terminal.log_line(line)}" for line in raw_tail[-TAIL_SHOWN:])
    events = doc.get("events") or []
    if events:
        out.append("")
        out.append("Recent events:")
        for e in events[-8:]:
            stamp = time.strftime("%H:%M:%S", time.localtime(float(e.get("at", 0))))
            detail = f" - {e['detail']}" if e.get("detail") else ""
            count = e.get("count")
            if isinstance(count, int) and count > 1:
                last = time.strftime("%H:%M:%S", time.localtime(float(e.get("last_at") or 0)))
                detail += f" (x{count}, last {last})"
            out.append(f"  {stamp} {e.get('from')} -> {e.get('to')} ({e.get('reason')}){detail}")
    return "\n".join(out)


def router_lines(router: Any, now: float) -> list[str]:
    """`/status.router`: where this SGLang is registered, or why not; nothing without
    router.url (`url` null; older daemons sent null for the whole object)."""
    if not isinstance(router, dict) or not router.get("url"):
        return []
    where = f"{router.get('url')} as {router.get('worker_url')}"
    if router.get("registered"):
        line = f"    Router: {where}, registered (worker {router.get('worker_id')})"
    elif router.get("wanted"):
        line = f"    Router: {where}, NOT REGISTERED (wanted: registering, retried with backoff)"
    else:
        line = f"    Router: {where}, not registered (not ready)"
    out = [line]
    if router.get("last_error"):
        when = _ago(router.get("last_error_at"), now)
        out.append(f"            last error {when}: {router['last_error']}")
    return out


def fetch(
    base: str,
    owners: frozenset[int],
    token: str | None,
    on_refused: Callable[[], None] | None = None,
) -> adminclient.Answer:
    """GET /status within DEADLINE_S; a token the daemon refuses (401) is said (`on_refused`)
    and the request made once more without it."""
    r = adminclient.request(
        "GET", base, "/status", trusted=owners, token=token, deadline=DEADLINE_S
    )
    if r.status == 401 and token:
        if on_refused is not None:
            on_refused()
        r = adminclient.request("GET", base, "/status", trusted=owners, deadline=DEADLINE_S)
    return r


def run_status_command(
    base: str,
    as_json: bool,
    out: TextIO,
    err: TextIO,
    token: str | None = None,
    trusted: frozenset[int] | None = None,
) -> int:
    """GET /status; with `token` the whole document, without it the daemon leaves out what
    SGLang printed (the log tail, messages quoting it). Only from a socket of root or the
    `trusted` users (default: root and this user), on a loopback address."""
    owners = trusted if trusted is not None else frozenset({0, os.geteuid()})

    def refused() -> None:
        # The daemon answered, so it is reachable: the state is still worth reporting.
        # Without the token /status is whole but for what SGLang printed.
        print(
            f"kimi-serve status: the daemon at {base} refused the admin token "
            "(was the token file replaced? the daemon reads it again on the next request); "
            "showing /status without it, SGLang's text left out",
            file=err,
        )

    try:
        r = fetch(base, owners, token, refused)
        if r.status != 200:
            raise ValueError(f"HTTP {r.status} {r.reason}")
        doc = r.json()
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except adminclient.NotTheService as exc:
        # The contract's `status` knows 0 / 3 / 4: the daemon is not what answers there, so it
        # is not reachable; the line says who holds the address instead.
        print(f"kimi-serve status: {exc}", file=err)
        return EX_UNREACHABLE
    except (adminclient.Unreachable, ValueError) as exc:
        print(
            f"kimi-serve status: cannot reach the daemon at {base} ({exc}); "
            "is it running? (systemctl status kimi-serve)",
            file=err,
        )
        return EX_UNREACHABLE
    if as_json:
        json.dump(doc, out, indent=2)
        out.write("\n")
    else:
        try:
            shown = render(doc, time.time())
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # Not what kimi-serve answers (an older or foreign server on the admin address):
            # no usable status, so not reachable in the contract's sense; --json shows it raw.
            print(
                f"kimi-serve status: the answer from {base} is not a kimi-serve status "
                f"({type(exc).__name__}: {exc}); see it with --json",
                file=err,
            )
            return EX_UNREACHABLE
        print(shown, file=out)
    return EX_READY if doc.get("state") in ("ready", "degraded") else EX_NOT_READY
