"""`kimi-serve incidents [show ID]`: the incident directories as an operator reads them, each
record read as untrusted (supervisor/incidents/__init__.py keeps the store)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, TextIO

from supervisor import terminal
from supervisor.core.states import DIED_REASONS, how_it_ended
from supervisor.incidents import (
    _READ_STACKS_MAX,
    INCIDENT_JSON,
    LOG_TAIL,
    STACKS,
    IncidentStore,
    read_record,
)
from supervisor.incidents.stacks import innermost, parse


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _summary_row(path: Path, doc: dict[str, Any]) -> dict[str, Any]:
    stacks = doc.get("stacks")
    stacks = stacks if isinstance(stacks, dict) else {}
    return {
        "id": path.name,
        "path": str(path),
        "at": doc.get("at"),
        "reason": doc.get("reason"),
        "launch": doc.get("launch"),
        "profile": doc.get("profile"),
        "exit_code": doc.get("exit_code"),
        "signal": doc.get("signal"),
        "detail": doc.get("detail"),
        "exception": doc.get("exception"),
        "stacks": bool(stacks.get("taken")),
        "stacks_reason": stacks.get("reason"),
    }


def run_list(store: IncidentStore, as_json: bool, out: TextIO, err: TextIO) -> int:
    rows = []
    for p in store.entries():
        try:
            rows.append(_summary_row(p, store.load(p)))
        except (OSError, ValueError) as exc:
            rows.append({"id": p.name, "path": str(p), "error": f"unreadable: {exc}"})
    if as_json:
        json.dump(rows, out, indent=2)
        out.write("\n")
        return 0
    if not rows:
        print(f"no incidents in {store.dir}", file=out)
        return 0
    rows = terminal.sanitized(rows)  # written by the daemon from what SGLang printed
    noun = "incident" if len(rows) == 1 else "incidents"
    print(f"{len(rows)} {noun} in {store.dir}, newest first:", file=out)
    for r in rows:
        if "error" in r:
            print(f"  {r['id']}  {r['error']}", file=out)
            continue
        how = f"signal {r['signal']}" if r.get("signal") else f"exit {r.get('exit_code')}"
        stacks = "stacks" if r["stacks"] else "no stacks"
        what = _text(r.get("exception")) or _text(r.get("detail"))
        print(f"  {r['id']}  {how:<10} {stacks:<9}  {what[:100]}", file=out)
    print("details: kimi-serve incidents show ID", file=out)
    return 0


def render_show(path: Path, doc: dict[str, Any], stacks_text: str | None) -> str:
    doc = terminal.sanitized(doc)
    out = [f"Incident {path.name}", f"  directory: {path}"]
    how = []
    if doc.get("exit_code") is not None:
        how.append(f"exit code {doc['exit_code']}")
    if doc.get("signal"):
        how.append(f"signal {doc['signal']}")
    out.append(
        f"  {doc.get('at_utc')}  {doc.get('reason')}  launch {doc.get('launch')}  "
        f"profile {doc.get('profile')} " + how_it_ended(doc.get("reason"), how)
    )
    if doc.get("detail"):
        out.append(f"  detail: {doc['detail']}")
    if doc.get("exception"):
        out.append(f"  exception: {doc['exception']}")
    timings = doc.get("timings") or {}
    phases = timings.get("load_phases") or {}
    if phases:
        out.append("  load: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    stacks = doc.get("stacks") or {}
    if stacks.get("seconds") is not None and stacks.get("taken") is not None:
        out.append(f"  stack dump took {stacks.get('seconds')} s")
    dump = doc.get("crash_dump")
    if dump:
        out.append(f"  SGLang crash dump: {dump.get('file') or '(none written)'}")
        out.append("    holds user prompts: handle as user data")
    for name, why in (doc.get("skipped") or {}).items():
        out.append(f"  skipped {name}: {why}")
    out.append("")
    if not stacks.get("taken"):
        out.append(f"No stacks: {stacks.get('reason') or 'none taken'}")
    elif stacks_text is not None:
        out.append("Innermost frames, per process (the frame it sits in first):")
        for d in parse(stacks_text):
            if d.error:
                out.append(f"  pid {d.pid} {d.name}: no stack ({d.error})")
                continue
            out.append(f"  pid {d.pid} {d.name}")
            out.extend(f"    {line}" for line in innermost(d))
    out.append("")
    # Only what is there: a file skipped for space, or removed since, is not offered.
    files = [str(n) for n in doc.get("files") or [] if _present(path, str(n))]
    # SGLang's own last words where it died or printed a fatal line; else only its last lines.
    died = doc.get("reason") in DIED_REASONS or doc.get("reason") == "fatal_log"
    tail_is = "the traceback" if died else "SGLang's last lines"
    why = f" ({LOG_TAIL}: {tail_is})" if LOG_TAIL in files else ""
    out.append(f"Files: {', '.join(files) or 'none besides what is shown'}{why}")
    return "\n".join(out)


def _present(directory: Path, name: str) -> bool:
    """`name` (from incident.json: a file's word) is a plain file in `directory` itself."""
    return name == Path(name).name and (directory / name).is_file()


def run_show(store: IncidentStore, ident: str, as_json: bool, out: TextIO, err: TextIO) -> int:
    path = store.find(ident)
    candidates = store.matching(ident) if path is None else []
    if len(candidates) > 1:
        print(
            f"kimi-serve incidents show: {ident!r} is ambiguous: {len(candidates)} incidents in "
            f"{store.dir} start with it (give more of the id):",
            file=err,
        )
        for p in candidates:
            print(f"  {p.name}", file=err)
        return 1
    if path is None:
        print(
            f"kimi-serve incidents show: no incident {ident!r} in {store.dir} "
            "(list them with `kimi-serve incidents`)",
            file=err,
        )
        return 1
    try:
        doc = store.load(path)
    except (OSError, ValueError) as exc:
        print(f"kimi-serve incidents show: {path / INCIDENT_JSON}: {exc}", file=err)
        return 1
    if as_json:
        json.dump(doc, out, indent=2)
        out.write("\n")
        return 0
    stacks_text = None
    with contextlib.suppress(OSError, ValueError):
        stacks_text = read_record(path / STACKS, _READ_STACKS_MAX).decode(errors="replace")
    try:
        shown = render_show(path, doc, stacks_text)
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # Fields of the wrong type: not written by kimi-serve. Say so; `--json` shows it raw.
        print(
            f"kimi-serve incidents show: {path / INCIDENT_JSON}: malformed "
            f"({type(exc).__name__}: {exc}); see it with --json",
            file=err,
        )
        return 1
    print(shown, file=out)
    return 0
