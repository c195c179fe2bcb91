"""What a stack dump before the kill adds to time-to-restart (docs/benchmarks.md, "Stack dumps").

    .venv/bin/python -m bench.stack_dump            # tp 1 and 8, 5 rounds each, about 20 s

Starts the SGLang stand-in with `--tp-size N` and its decode-hang fault, hangs one request, then
times `supervisor.incidents.stacks.capture()` over the main process and every child (what the daemon
dumps before a liveness_failed kill): native frames on, then off. Also the same with a py-spy
that hangs (the budget, 2 s here, is what it costs at worst).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.incidents.stacks import capture
from testkit import free_port
from testkit.standin import Standin

ROUNDS = 5


async def measure(pids: list[int], native: bool, py_spy: str | None = None) -> list[float]:
    out = []
    for _ in range(ROUNDS):
        started = time.monotonic()
        cap = await capture(pids, timeout=2.0 if py_spy else 10.0, native=native, py_spy=py_spy)
        out.append(time.monotonic() - started)
        assert py_spy or all(s.ok for s in cap.stacks), cap.reason
    return out


def main() -> None:
    hanging = Path("/tmp/kimi-bench-hanging-py-spy")
    hanging.write_text("#!/bin/sh\nexec sleep 1000\n")
    hanging.chmod(0o755)
    print("| processes | native | median s | max s |")
    print("|---|---|---|---|")
    for tp in (1, 8):
        port = free_port()
        env = {"STANDIN_FAULT": "decode-hang", "STANDIN_HANG_AFTER_DECODES": "0"}
        s = Standin(["--model-path", "/m", "--port", str(port), "--tp-size", str(tp)], env, port)
        try:
            s.wait_ready()
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(s.url("/generate"), json={"text": "x"}, timeout=0.3)
            s.wait_line("Prefill batch")
            pids = [s.proc.pid, *(c.pid for c in psutil.Process(s.proc.pid).children(True))]
            for native in (True, False):
                t = asyncio.run(measure(pids, native))
                print(f"| {len(pids)} | {native} | {statistics.median(t):.3f} | {max(t):.3f} |")
            t = asyncio.run(measure(pids, True, str(hanging)))
            print(
                f"| {len(pids)} | hanging py-spy, 2 s budget | {statistics.median(t):.3f} | "
                f"{max(t):.3f} |"
            )
        finally:
            s.cleanup()


if __name__ == "__main__":
    main()
