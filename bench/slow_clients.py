"""/livez under the slow-client attack (docs/benchmarks.md, "Slow clients").

    .venv/bin/python -m bench slow-clients                   # 70 and 200 clients, 20 s each
    .venv/bin/python -m bench slow-clients --clients 70 --seconds 60

The real daemon on the stand-in, ready; then N loopback connections each send a request head
one byte every 0.3 s, never finishing it, and open again at once when cut
(testkit.slowclients.Trickle, in a process of its own). Meanwhile GET /livez, /readyz and
/metrics in turn, each on a fresh connection, every 0.1 s (testkit.slowclients.Prober). One
row per N: how many probes failed (no answer within 5 s, or not 200) and the /livez latency.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.common import parser
from testkit import base_config, running
from testkit.slowclients import Prober, Summary, TrickleProcess


def attack(clients: int, interval: float, seconds: float) -> tuple[Summary, dict[str, int]]:
    with tempfile.TemporaryDirectory(prefix="kimi-bench-slow-") as tmp:
        cfg = base_config(Path(tmp))
        with running(Path(tmp), cfg) as d:
            d.wait_state("ready")
            host, port = cfg["admin"]["listen"].rsplit(":", 1)
            attacker = TrickleProcess(host, int(port), clients, interval)
            with attacker as t, Prober(d.admin, every=0.1, timeout=5.0) as p:
                time.sleep(seconds)
            assert d.status()["restarts"] == {}, "SGLang was restarted"
    return p.summary, t.stats


def main(argv: list[str] | None = None) -> int:
    ap = parser("slow-clients", __doc__)
    ap.add_argument("--clients", type=int, action="append", help="default: 70 and 200")
    ap.add_argument("--interval", type=float, default=0.3, help="seconds between bytes")
    ap.add_argument("--seconds", type=float, default=20.0, help="probing time per row")
    args = ap.parse_args(argv)
    print(
        "| trickling clients | byte every | probes | failed | /livez p50 ms | /livez p99 ms "
        "| slowest probe ms | attacking connections | cut |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.clients or [70, 200]:
        s, t = attack(n, args.interval, args.seconds)
        print(
            f"| {n} | {args.interval:g} s | {len(s.results)} | {len(s.failures)} "
            f"| {s.quantile(0.5, '/livez') * 1000:.0f} | {s.quantile(0.99, '/livez') * 1000:.0f} "
            f"| {s.slowest() * 1000:.0f} | {t['connections']} | {t['cut']} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
