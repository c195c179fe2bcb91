"""A log writer at set rates, launched in SGLang's place (or straight to /dev/null).

    python -m bench.flood [SGLang's flags, ignored]    # as `sglang.module: bench.flood`

Settings come from the environment, as the stand-in's do:
  BENCH_FLOOD_PLAN    "rate:seconds,..." lines per second (0 = as fast as it can) and for how
                      long; a 0-rate step writes BENCH_FLOOD_MAX_LINES lines instead
  BENCH_FLOOD_MAX_LINES  lines of an unthrottled step (default 300000)
  BENCH_FLOOD_RESULT  file to append one JSON line per step to
  BENCH_FLOOD_GAP     seconds of quiet between steps (default 0.5)

Each line is one write(), as Python's logging writes a record, shaped like the scheduler's
decode-batch line (the stand-in's log-flood fault). stderr is made non-blocking, so a write
that would have blocked is seen (EAGAIN): it is counted, and the time until the pipe took the
line again is added to `blocked_s`. Between steps the writer waits until the reader has
emptied the pipe (FIONREAD), so each step's `drained` marks when the reader caught up. The
pipe's fill is sampled every pacing tick (1 ms): its median and peak show whether a reader
keeps up evenly or in bursts.
After the plan it sleeps until killed, as a server would.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import stat
import struct
import sys
import termios
import time
from typing import Any

FD = 2
LINE = (
    "[%s TP0] Decode batch, #running-req: 1, #token: %d, token usage: 0.01, cuda graph: "
    "True, gen throughput (token/s): 88.00, #queue-req: 0\n"
)
_F_GETPIPE_SZ = 1032


def _pending(fd: int) -> int:
    """Bytes waiting in the pipe (0 for anything that is not a pipe)."""
    try:
        raw = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return 0
    return int(struct.unpack("i", raw)[0])


def plan_from(text: str) -> list[tuple[float, float]]:
    steps = []
    for part in text.split(","):
        rate, _, seconds = part.partition(":")
        steps.append((float(rate), float(seconds or 1)))
    return steps


def run_step(
    fd: int, rate: float, seconds: float, max_lines: int, is_pipe: bool
) -> dict[str, float]:
    total = max_lines if rate <= 0 else int(rate * seconds)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    written = 0
    eagain = 0
    blocked = 0.0
    peak = 0
    fills: list[int] = []  # bytes waiting in the pipe, once per pacing tick
    start_wall = time.time()
    t0 = time.monotonic()
    while written < total:
        due = total if rate <= 0 else min(total, int((time.monotonic() - t0) * rate) + 1)
        while written < due:
            data = (LINE % (stamp, written)).encode()
            while True:
                try:
                    os.write(fd, data)  # < PIPE_BUF: all or nothing
                    break
                except BlockingIOError:
                    eagain += 1
                    b0 = time.monotonic()
                    select.select([], [fd], [])
                    blocked += time.monotonic() - b0
            written += 1
        if is_pipe:
            fills.append(_pending(fd))
            peak = max(peak, fills[-1])
        if rate > 0 and written < total:
            time.sleep(0.001)
    elapsed = time.monotonic() - t0
    end_wall = time.time()
    while is_pipe and _pending(fd) > 0:
        time.sleep(0.001)
    return {
        "rate": rate,
        "lines": written,
        "start": start_wall,
        "end": end_wall,
        "drained": time.time(),
        "achieved": written / elapsed if elapsed > 0 else 0.0,
        "eagain": eagain,
        "blocked_s": blocked,
        "peak_pipe_bytes": peak,
        "median_pipe_bytes": sorted(fills)[len(fills) // 2] if fills else 0,
    }


def main() -> int:
    plan = plan_from(os.environ.get("BENCH_FLOOD_PLAN", "10000:1"))
    max_lines = int(os.environ.get("BENCH_FLOOD_MAX_LINES", "300000"))
    gap = float(os.environ.get("BENCH_FLOOD_GAP", "0.5"))
    result = os.environ.get("BENCH_FLOOD_RESULT")
    is_pipe = stat.S_ISFIFO(os.fstat(FD).st_mode)
    capacity = 0
    if is_pipe:
        os.set_blocking(FD, False)
        with contextlib.suppress(OSError):
            capacity = fcntl.fcntl(FD, _F_GETPIPE_SZ)

    def record(doc: dict[str, Any]) -> None:
        if result:
            with open(result, "a") as f:
                f.write(json.dumps(doc) + "\n")

    for rate, seconds in plan:
        time.sleep(gap)
        record(run_step(FD, rate, seconds, max_lines, is_pipe) | {"pipe_capacity": capacity})
    record({"done": True})
    if "--exit" in sys.argv:
        return 0
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    raise SystemExit(main())
