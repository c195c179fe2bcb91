"""Runs the reliability suite and prints the table of docs/reliability.md from its results.

    .venv/bin/python -m tests.reliability.report            # run tests/reliability, print
    .venv/bin/python -m tests.reliability.report FILE.json  # print from an earlier run's file
    KIMI_SERVE_RELIABILITY_REPEAT=20 KIMI_SERVE_RELIABILITY_SOAK=5 \\
        .venv/bin/python -m tests.reliability.report        # a soak

Every test of the suite records one line per injected fault (testkit/reliability.py,
`trial()`); conftest.py writes them to $KIMI_SERVE_RELIABILITY_REPORT at the end of the session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = (
    "Fault injected",
    "Runs",
    "Recovered",
    "False ready",
    "Orphans",
    "Tracebacks shown",
    "Notes",
)


def run_suite(out: Path, extra: list[str]) -> tuple[int, float]:
    env = {**os.environ, "KIMI_SERVE_RELIABILITY_REPORT": str(out)}
    start = time.monotonic()
    code = subprocess.call(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/reliability",
            *extra,
        ],
        cwd=ROOT,
        env=env,
    )
    return code, time.monotonic() - start


def _notes(category: str, rows: list[dict[str, Any]]) -> str:
    notes: list[str] = []
    reasons = Counter(r["notes"]["reason"] for r in rows if "reason" in r["notes"])
    if reasons:
        notes.append("restart: " + ", ".join(f"{k} x{v}" for k, v in sorted(reasons.items())))
    gaps = [r["notes"]["watchdog_gap_s"] for r in rows if "watchdog_gap_s" in r["notes"]]
    if gaps:
        notes.append(f"max WATCHDOG=1 gap {max(gaps):.2f} s")
    stops = [r["notes"]["stop_s"] for r in rows if "stop_s" in r["notes"]]
    if stops:
        notes.append(f"stop took <= {max(stops):.1f} s")
    if category == "random fault sequences":
        steps = sum(len(r["notes"].get("steps", [])) for r in rows)
        faulty = sum(len(r["notes"].get("faulty_launches", [])) for r in rows)
        notes.append(f"{steps} steps, {faulty} launches with a fault")
    for r in rows:
        n = r["notes"]
        if "detect_quiet_ms" in n:
            notes.append(
                f"detection {n['detect_quiet_ms']} ms quiet / {n['detect_loaded_ms']} ms loaded "
                f"(median), ready again {n['ready_quiet_s']} / {n['ready_loaded_s']} s, "
                f"{n['requests']} admin requests, {n['errors']} errors"
            )
        if "hoard evicted" in n:
            notes.append(
                f"detection {n['detect_ms']} ms; {n['hoard evicted']} hoarded connections "
                f"closed for newcomers, {n['slowloris cut']} slowloris cut, {n['big body']} "
                f"oversized bodies, {n['garbage']} malformed, {n['denied']} wrong tokens denied; "
                f"slowest fresh /livez {n['livez_max_ms']} ms"
            )
    bugs = sorted({r["known_bug"] for r in rows if r["known_bug"]})
    if bugs:
        notes.append("; ".join(bugs))
    failed = sum(not r["passed"] and not r["known_bug"] for r in rows)
    if failed:
        notes.append(f"**{failed} FAILED**")
    return "; ".join(notes)


ORDER = (
    "fault matrix",
    "random fault sequences",
    "malformed answers",
    "daemon crashes",
    "environment faults",
    "admin load",
)


def _group(results: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    rank = {c: i for i, c in enumerate(ORDER)}
    for r in sorted(results, key=lambda r: rank.get(r["category"], len(ORDER))):
        groups[(r["category"], r["case"])].append(r)
    return groups


def _rows(groups: dict[tuple[str, str], list[dict[str, Any]]], totals: Counter[str]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    last_category = None
    for (category, case), rows in groups.items():
        if category != last_category:
            lines.append(f"| **{category}** |  |  |  |  |  |  |")
            last_category = category
        counts = {
            "runs": len(rows),
            "recovered": sum(r["recovered"] for r in rows),
            "false_ready": sum(r["false_ready"] for r in rows),
            "orphans": sum(r["orphans"] for r in rows),
            "tracebacks": sum(r["tracebacks"] for r in rows),
        }
        totals.update(counts)
        lines.append(
            f"| {case} | {counts['runs']} | {counts['recovered']} | {counts['false_ready']} | "
            f"{counts['orphans']} | {counts['tracebacks']} | {_notes(category, rows)} |"
        )
    return lines


def table(results: list[dict[str, Any]]) -> str:
    """The suite's table, and under it the known daemon bugs (strict xfail tests) apart."""
    totals = Counter[str]()
    lines = _rows(_group([r for r in results if not r["known_bug"]]), totals)
    lines.append(
        f"| **total** | **{totals['runs']}** | **{totals['recovered']}** | "
        f"**{totals['false_ready']}** | **{totals['orphans']}** | **{totals['tracebacks']}** |  |"
    )
    bugs = [r for r in results if r["known_bug"]]
    if bugs:
        lines += [
            "",
            "Known daemon bugs (tests marked `xfail(strict=True)`; they pass once fixed):",
            "",
        ]
        lines += _rows(_group(bugs), Counter())
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv and argv[0].endswith(".json"):
        print(table(json.loads(Path(argv[0]).read_text())))
        return 0
    try:
        import pytest  # noqa: F401  (only asked whether it is there)
    except ImportError:
        # scripts/demo's setup has no test tools; the suite this runs needs them.
        print(
            "python -m tests.reliability.report runs the reliability suite, which needs the test "
            "tools: run scripts/setup --test first (a results FILE.json prints without them)",
            file=sys.stderr,
        )
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "reliability.json"
        code, took = run_suite(out, argv)
        if not out.exists():
            print("the suite recorded nothing", file=sys.stderr)
            return code or 1
        print()
        print(table(json.loads(out.read_text())))
        print(f"\n`tests/reliability`: pytest exit {code}, {took:.0f} s wall clock.")
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
