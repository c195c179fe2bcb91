"""Where the log pump's time goes, per line: `python -m bench profile-pump [--lines N]`.

Feeds the scheduler's decode-batch lines (the log pump benchmark's lines) through the daemon's
own code path — `_Pump._readable` reading a real pipe, then `LogPump.lines` (count, scan,
forward at most 2000 a second) — once under cProfile, and times the pieces separately:
splitting and decoding, the fatal-pattern scan, the metric. No process is started; the
daemon's log goes to /dev/null.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import os
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import parser, write_yaml
from bench.flood import LINE
from supervisor import config as config_mod
from supervisor import log
from supervisor.sglang.logscan import LogScanner, Stream, guess_level
from testkit import base_config


def _lines(n: int) -> list[str]:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return [(LINE % (stamp, i)).rstrip("\n") for i in range(n)]


def _each(fn: Any, items: Any) -> None:
    for item in items:
        fn(item)


def _per_line(fn: Any, lines: list[str]) -> float:
    t0 = time.perf_counter()
    fn(lines)
    return (time.perf_counter() - t0) / len(lines) * 1e6


async def _through_pipe(daemon: Any, data: bytes) -> float:
    """The real pump: a pipe, the loop's reader callback, LogPump.lines. Seconds per line."""
    from supervisor.process.pipes import _Pump

    class _Child:
        launch = 1
        _open_pipes = 2
        pipes_closed = asyncio.Event()

    r, w = os.pipe()
    os.set_blocking(r, False)
    done = asyncio.Event()
    seen = 0
    total = data.count(b"\n")

    def sink(launch: int, stream: Stream, lines: list[str]) -> None:
        nonlocal seen
        daemon.pump.lines(launch, stream, lines)
        seen += len(lines)
        if seen >= total:
            done.set()

    pump = _Pump(_Child(), Stream.STDERR, r, sink)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    writer = loop.run_in_executor(None, _write_all, w, data)
    await done.wait()
    elapsed = time.perf_counter() - t0
    await writer
    pump.close()
    return elapsed / total


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[:65536]) :]
    os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = parser("profile-pump", __doc__)
    p.add_argument("--lines", type=int, default=200_000)
    a = p.parse_args(argv)

    from supervisor.daemon.loop import Daemon

    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as devnull:
        path = write_yaml(Path(tmp) / "kimi-serve.yaml", base_config(Path(tmp)))
        cfg = config_mod.load(str(path))
        log.setup("json", "info", stream=devnull, prefix=False)
        lines = _lines(a.lines)
        data = "".join(line + "\n" for line in lines).encode()

        async def run() -> dict[str, float]:
            daemon = Daemon(cfg)
            # A launch still loading: every line also goes through the load timeline (the
            # costlier case; once the load is complete the timeline drops lines at once).
            daemon.recorder.launched(1, "primary", time.monotonic())
            out: dict[str, float] = {}
            scanner = LogScanner(cfg.logs.fatal_patterns, cfg.logs.tail_lines)
            out["scan (LogScanner.feed)"] = _per_line(
                lambda ls: [scanner.feed(x) for x in ls], lines
            )
            out["split + decode"] = _per_line(
                lambda ls: [x.decode("utf-8", "replace").rstrip("\r") for x in data.split(b"\n")],
                lines,
            )
            metric = daemon.metrics.log_lines.labels("stderr")
            out["metric, one inc per line"] = _per_line(
                lambda ls: _each(lambda _: metric.inc(), ls), lines
            )
            out["LogPump.lines (count, scan, forward ≤2000/s)"] = _per_line(
                lambda ls: _each(
                    lambda i: daemon.pump.lines(1, Stream.STDERR, ls[i : i + 430]),
                    range(0, len(ls), 430),
                ),
                lines,
            )
            sglog = log.get("sglang")
            out["forwarding one line to the daemon's own log (/dev/null here)"] = _per_line(
                lambda ls: _each(
                    lambda x: getattr(sglog, guess_level(x))(x, source="sglang", stream="stderr"),
                    ls,
                ),
                lines[:2000],
            )
            out["whole pump: pipe → _Pump → LogPump.lines"] = (
                await _through_pipe(daemon, data)
            ) * 1e6
            prof = cProfile.Profile()
            prof.enable()
            await _through_pipe(daemon, data)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
            print(text.getvalue())
            await daemon.fx.http.aclose()
            return out

        results = asyncio.run(run())
    print(f"{a.lines} lines of {len(lines[0]) + 1} bytes; microseconds per line:")
    for name, us in results.items():
        print(f"  {us:6.2f}  {name}   (one core: {1e6 / us / 1000:,.0f}k lines/s)")
    burst = results["forwarding one line to the daemon's own log (/dev/null here)"] * 2
    print(
        f"The forward budget (2000 lines) is spent at the start of each second: a {burst:.0f}-ms "
        "burst in which the pump falls behind."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
