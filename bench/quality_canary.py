"""`python -m bench quality-canary`: the daemon's canary comparison against a bare real server.

    SGLANG_ENV_DIR=/path/to/env .venv/bin/python -m bench quality-canary [--n 35]

One real SGLang 0.5.23 server (testkit/realsglang.py) serving the canary model of
tools/make-canary-model. The first canary answer (supervisor.quality.asking.ask) is the
golden;
then `--n` canaries in each of three conditions are compared with it exactly as the daemon
compares them (supervisor.quality.compare):

- `idle`: nothing else runs;
- `radix`: the same prompt generated right before (a radix-cache hit: cached_tokens > 0);
- `load`: 3 other clients generate 48-token texts meanwhile.

Printed per condition: canaries, matches, token-for-token identical answers, the canary's cost
(median and max, ms); then the lowest margin seen. docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import threading
from pathlib import Path

import httpx

from bench.common import parser
from supervisor import quality
from supervisor.quality.asking import ask
from testkit import realsglang as real


def _load(url: str, stop: threading.Event, i: int) -> None:
    body = {
        "text": f"Story {i}: once upon a time",
        "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True},
    }
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(url + "/generate", json=body, timeout=120)


async def _measure(url: str, n: int) -> None:
    prompt, tokens = real.CANARY_PROMPT, real.CANARY_TOKENS
    async with httpx.AsyncClient() as http:
        golden, _ = await ask(http, url, prompt, tokens, 120.0)
        if isinstance(golden, str):
            raise SystemExit(f"no golden: {golden}")
        print(f"golden {golden.text!r}, margins {[round(m or 0, 2) for m in golden.margins]}")
        lowest = min(m for m in golden.margins if m is not None)
        for phase in ("idle", "radix", "load"):
            stop = threading.Event()
            threads = [threading.Thread(target=_load, args=(url, stop, i)) for i in range(3)]
            if phase == "load":
                for t in threads:
                    t.start()
            matches = identical = 0
            costs: list[float] = []
            try:
                for _ in range(n):
                    if phase == "radix":
                        body = {
                            "text": prompt,
                            "sampling_params": {"max_new_tokens": tokens, "temperature": 0},
                        }
                        await http.post(url + "/generate", json=body, timeout=120)
                    got, took = await ask(http, url, prompt, tokens, 120.0)
                    if isinstance(got, str):
                        print(f"{phase}: {got}")
                        continue
                    costs.append(took * 1000)
                    matches += quality.compare(golden, got).match
                    identical += got.tokens == golden.tokens
                    lowest = min(lowest, *(m for m in got.margins if m is not None))
            finally:
                stop.set()
                for t in threads:
                    if t.is_alive():
                        t.join()
            print(
                f"{phase}: {len(costs)} canaries, {matches} match, {identical} identical, "
                f"cost median {statistics.median(costs):.0f} ms, max {max(costs):.0f} ms"
            )
        print(f"lowest margin seen: {lowest:.2f} nats")


def main(argv: list[str] | None = None) -> int:
    ap = parser("quality-canary", __doc__)
    ap.add_argument("--n", type=int, default=35, help="canaries per condition")
    args = ap.parse_args(argv)
    sgl = real.canary_env(real.build_env())
    with tempfile.TemporaryDirectory() as tmp, real.running(sgl, Path(tmp) / "server.log") as srv:
        print(f"server started in {srv.started_in:.0f} s")
        asyncio.run(_measure(srv.url, args.n))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
