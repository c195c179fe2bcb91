"""What a stack dump before the kill adds to time-to-restart (docs/benchmarks.md, "Stack dumps").

    .venv/bin/python -m bench stack-dump            # tp 1 and 8, 5 rounds each, about 20 s
    .venv/bin/python -m bench stack-dump --tp 1 --rounds 1 --budget 0.5   # the suite's form

Starts the SGLang stand-in with `--tp-size N` and its decode-hang fault, hangs one request, then
times `supervisor.incidents.stacks.capture()` over the main process and every child (what the daemon
dumps before a liveness_failed kill): native frames on, then off. Also the same with a py-spy
that hangs (the budget, 2 s here, is what it costs at worst).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.common import parser
from supervisor.incidents.stacks import capture
from testkit import free_port
from testkit.standin import Standin


async def measure(
    pids: list[int], native: bool, rounds: int, py_spy: str | None = None, budget: float = 10.0
) -> list[float]:
    out = []
    for _ in range(rounds):
        started = time.monotonic()
        cap = await capture(pids, timeout=budget, native=native, py_spy=py_spy)
        out.append(time.monotonic() - started)
        assert py_spy or all(s.ok for s in cap.stacks), cap.reason
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser("stack-dump", __doc__, rounds=5)
    ap.add_argument("--tp", type=int, action="append", help="--tp-size (default: 1 and 8)")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds for the hanging py-spy")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kimi-bench-stacks-"))
    hanging = work / "hanging-py-spy"
    hanging.write_text("#!/bin/sh\nexec sleep 1000\n")
    hanging.chmod(0o755)
    print("| processes | native | median s | max s |")
    print("|---|---|---|---|")
    for tp in args.tp or (1, 8):
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
                t = asyncio.run(measure(pids, native, args.rounds))
                print(f"| {len(pids)} | {native} | {statistics.median(t):.3f} | {max(t):.3f} |")
            t = asyncio.run(measure(pids, True, args.rounds, str(hanging), args.budget))
            print(
                f"| {len(pids)} | hanging py-spy, {args.budget:g} s budget "
                f"| {statistics.median(t):.3f} | {max(t):.3f} |"
            )
        finally:
            s.cleanup()
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
