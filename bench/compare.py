"""`python -m bench`: kimi-serve against supervisord, systemd and a /health poller, on the
SGLang stand-in, in one run; `python -m bench NAME --help` for each of the other benches
(listed below). See docs/benchmarks.md.

    .venv/bin/python -m bench                 # everything, about 5 minutes
    .venv/bin/python -m bench --quick         # tiny sizes, well under 30 s
    .venv/bin/python -m bench --only kimi-serve,health-poller --json out.json
    .venv/bin/python -m bench --real-sglang 3  # plus the real SGLang 0.5.23 rows (3 launches)
    .venv/bin/python -m bench --downtime 2     # instead: restart downtime, real SGLang (root)
    .venv/bin/python -m bench --canary 100     # plus greedy stability on the real server
                                               # (as `canary`: 5 launches, ~20 minutes)

Phase A runs alone, one approach at a time (millisecond figures: readiness, death detection,
recovery, log pump). Phase B runs the footprint measurement and, beside it, the figures that
are counted in seconds or in verdicts (hang detection, false ready, the poller's cycles).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from bench import BENCHES, canary, downtime, real_sglang, report, scenarios
from bench import supervisord as sv_mod
from bench.common import RUN_ID, Procs, sweep_marked
from bench.scenarios import APPROACHES, KIMI, POLLER, SUPERVISORD, SYSTEMD, Ctx, Settings
from bench.systemd_box import SystemdBox
from bench.systemd_box import Unavailable as BoxUnavailable


def _value(path: str, key: str, sep: str) -> str | None:
    """The value of the first `key<sep>value` line of a text file (None: none there)."""
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(sep, 1)[1].strip()
    return None


def machine() -> dict[str, Any]:
    return {
        "cpu": _value("/proc/cpuinfo", "model name", ":") or "",
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "os": (_value("/etc/os-release", "PRETTY_NAME=", "=") or "").strip('"')
        or platform.system(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "processes": len(psutil.pids()),
        "gpu": "none (the SGLang stand-in, supervisor/standin)",
    }


def reason(exc: Exception) -> str:
    """An exception as a `not_measured` entry: its type and the first line of its message."""
    first = (str(exc).strip().splitlines() or ["(no message)"])[0][:300]
    return f"{type(exc).__name__}: {first}"


Job = tuple[str, Callable[[], Any], Callable[[Any], None]]  # name, run, store the result


class Runner:
    def __init__(self, ctx: Ctx, results: dict[str, Any]) -> None:
        self.ctx = ctx
        self.results = results
        self.lock = threading.Lock()

    def guard(self, name: str, fn: Callable[[], Any], store: Callable[[Any], None]) -> None:
        """Run one scenario; a failure is recorded as `not_measured` and the bench goes on."""
        t0 = time.monotonic()
        try:
            value = fn()
        except Exception as exc:
            self.ctx.say(f"! {name}: {reason(exc)}")
            with self.lock:
                self.results["not_measured"][name] = reason(exc)
            return
        with self.lock:
            store(value)
            self.results["durations"][name] = round(time.monotonic() - t0, 1)

    def job(self, approach: str, key: str, fn: Callable[[Ctx], Any]) -> Job:
        """`fn(ctx)` stored as results[approach][key]; for "faults" its false_ready and hang."""

        def store(value: Any) -> None:
            got = (
                {k: value[k] for k in ("false_ready", "hang")} if key == "faults" else {key: value}
            )
            self.results.setdefault(approach, {}).update(got)

        return f"{approach}/{key}", lambda: fn(self.ctx), store

    def whole(self, name: str, fn: Callable[[Ctx, bool], Any], with_sv: bool) -> None:
        """`fn(ctx, with_sv)` stored as results[name]."""
        self.guard(name, lambda: fn(self.ctx, with_sv), lambda v: self.results.update({name: v}))

    def lane(self, name: str, jobs: list[Job]) -> threading.Thread:
        def run() -> None:
            for job in jobs:
                self.guard(*job)

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t


def run(settings: Settings, only: tuple[str, ...], root: Path) -> dict[str, Any]:
    procs = Procs()
    stale = sweep_marked(stale=True)
    results: dict[str, Any] = {
        "machine": machine(),
        "settings": asdict(settings),
        "approaches": list(only),
        "not_measured": {},
        "durations": {},
        "started": time.time(),
        "run_id": RUN_ID,
    }
    if stale:
        results["stale_processes_removed"] = stale
    start = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - start:6.1f} s] {text}", file=sys.stderr, flush=True)

    ctx = Ctx(procs=procs, root=root, s=settings, progress=say)
    r = Runner(ctx, results)
    want_sv = SUPERVISORD in only
    if want_sv:
        try:
            sv_mod.ensure()
        except sv_mod.Unavailable as exc:
            results["not_measured"][SUPERVISORD] = str(exc)
            want_sv = False
    if SYSTEMD in only:
        try:
            ctx.box = SystemdBox(root)
        except BoxUnavailable as exc:
            results["not_measured"][SYSTEMD] = f"systemd box unavailable: {exc}"
    try:
        say("phase A: readiness, death detection and recovery, one approach at a time")
        r.guard(*r.job(KIMI, "cycles", scenarios.kimi_cycles))
        if want_sv:
            r.guard(*r.job(SUPERVISORD, "cycles", scenarios.supervisord_cycles))
        if ctx.box is not None:
            r.guard(*r.job(SYSTEMD, "cycles", scenarios.systemd_cycles))
        say("phase A: log pump")
        r.whole("log_pump", scenarios.log_pump, want_sv)

        say(
            f"phase B: footprint for {settings.footprint_s:.0f} s; beside it hang, false "
            "ready and the poller"
        )
        # kimi-serve is always measured (compare() insists on it).
        lane1 = [r.job(KIMI, "hang", scenarios.kimi_hang)]
        lane1.append(r.job(KIMI, "false_ready", scenarios.kimi_false_ready))
        if POLLER in only:
            lane1.append(r.job(POLLER, "cycles", scenarios.poller_cycles))
        lanes = [r.lane("lane1", lane1)]

        lane2: list[Job] = []
        if want_sv:
            lane2.append(r.job(SUPERVISORD, "faults", scenarios.supervisord_faults))
        if ctx.box is not None:
            lane2.append(r.job(SYSTEMD, "faults", scenarios.systemd_faults))
        lanes.append(r.lane("lane2", lane2))
        if POLLER in only:
            lanes.append(r.lane("lane3", [r.job(POLLER, "faults", scenarios.poller_faults)]))
        r.whole("footprint", scenarios.footprint, want_sv)
        for lane in lanes:
            lane.join()
    finally:
        if ctx.box is not None:
            changes = ctx.box.stop()
            if changes:
                results["box_host_changes"] = changes
        results["left_behind"] = procs.cleanup()
        results["machine"]["loadavg_end"] = os.getloadavg()
        results["seconds"] = round(time.monotonic() - start, 1)
    return results


def compare(argv: list[str]) -> int:
    width = max(map(len, BENCHES))
    p = argparse.ArgumentParser(
        prog="python -m bench",
        usage="python -m bench [options]  |  python -m bench NAME [--help] [ARGS...]",
        description=__doc__,
        epilog="other benches (NAME):\n"
        + "\n".join(f"  {n:<{width}}  {what}" for n, (_m, what) in BENCHES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run, < 30 s)")
    p.add_argument(
        "--only",
        default=",".join(APPROACHES),
        help=f"comma-separated subset of {', '.join(APPROACHES)}",
    )
    p.add_argument("--json", type=Path, help="write the raw results here")
    p.add_argument("--markdown", type=Path, help="write the tables as Markdown here")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    for flag, metavar, what in (
        ("--real-sglang", "ROUNDS", "also ROUNDS launches on the real SGLang server (as "
         "`real-sglang`; needs tools/sglang-env, about a minute each)"),
        ("--downtime", "ROUNDS", "instead: the restart-downtime rows on real SGLang with a "
         "larger model (as `downtime`; root, drops the page cache; several minutes per round)"),
        ("--canary", "N", "also N greedy canary generations per condition on the real SGLang "
         "server (as `canary`; needs tools/sglang-env, five launches)"),
    ):  # fmt: skip
        p.add_argument(flag, type=int, default=0, metavar=metavar, help=what)
    a = p.parse_args(argv)
    if a.downtime > 0:
        json_out = ["--json", str(a.json)] if a.json else []
        return downtime.main(["--rounds", str(a.downtime), *json_out])
    only = tuple(x.strip() for x in a.only.split(",") if x.strip())
    unknown = ", ".join(sorted(set(only) - set(APPROACHES)))
    if unknown:
        p.error(f"unknown approach(es) {unknown}; choose from {', '.join(APPROACHES)}")
    if KIMI not in only:
        p.error("kimi-serve is what the bench measures; keep it in --only")
    settings = Settings.tiny() if a.quick else Settings()

    # SIGTERM/SIGHUP end the run like Ctrl-C does, through the cleanup below.
    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)
    root = Path(tempfile.mkdtemp(prefix="kimi-bench-"))
    try:
        results = run(settings, only, root)
    except KeyboardInterrupt:
        print("interrupted; everything the bench started was stopped", file=sys.stderr)
        return 130
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    real_table = ""
    if a.real_sglang > 0:
        try:
            done = real_sglang.rows(a.real_sglang)
            summary = real_sglang.summarise(done)
            results["real_sglang"] = {"rounds": done, "summary": summary}
            real_table = real_sglang.table(summary, a.real_sglang)
        except Exception as exc:
            results["not_measured"]["real_sglang"] = reason(exc)
    if a.canary > 0:
        try:
            with tempfile.TemporaryDirectory(prefix="kimi-bench-canary-") as work:
                results["canary"] = canary.run(a.canary, Path(work))
            real_table = (real_table + "\n\n" + canary.table(results["canary"])).strip()
        except Exception as exc:
            results["not_measured"]["canary"] = reason(exc)
    tables = report.all_tables(results)
    m = results["machine"]
    head = (
        f"kimi-serve bench ({'quick' if a.quick else 'full'}) on {m['cpu']}, {m['cores']} "
        f"cores, {m['memory_gib']} GiB, {m['os']}, kernel {m['kernel']}, Python "
        f"{m['python']}; load average {m['loadavg_start'][0]:.2f} → "
        f"{m['loadavg_end'][0]:.2f}; {results['seconds']:.0f} s"
    )
    print(f"{head}\n\n{report.text(tables)}")
    if real_table:
        print(f"\n{real_table}")
    for name, why in results["not_measured"].items():
        print(f"not measured: {name}: {why}")
    if results["left_behind"]:
        print(f"LEFT BEHIND (killed by the final sweep): {results['left_behind']}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))
    if a.markdown:
        real_md = f"\n\n```\n{real_table}\n```\n" if real_table else ""
        a.markdown.write_text(head + "\n\n" + report.markdown(tables) + real_md)
    return 1 if results["left_behind"] else 0


if __name__ == "__main__":
    raise SystemExit(compare(sys.argv[1:]))
