"""`python -m bench.multinode`: a two-node replica's relaunch, simulated on one machine.

    .venv/bin/python -m bench.multinode [--rounds 5]

Two real daemons (`kimi-serve run`), two stand-ins in multi-node mode (rank 0 and rank 1 meet
at --dist-init-addr), loopback admin endpoints, one shared token, `group.poll_interval` 0.2 s.
Per round, one node's SGLang main process is SIGKILLed (alternately the follower's and the
leader's): the time until every node's /readyz answers 503, and until both answer 200 again,
with the stand-in's own load and warm-up (0.4 s per launch) taken out. docs/benchmarks.md has
the figures.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
from pathlib import Path

from testkit import running
from testkit.pair import node_configs, ready, until_all

LOAD_S = 0.3 + 0.1  # base_config: STANDIN_LOAD_SECONDS + STANDIN_WARMUP_SECONDS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    rounds = ap.parse_args().rounds
    out: dict[str, tuple[list[float], list[float]]] = {"follower": ([], []), "leader": ([], [])}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        leader_cfg, follower_cfg = node_configs(tmp)
        with (
            running(tmp / "node0", leader_cfg) as leader,
            running(tmp / "node1", follower_cfg) as follower,
        ):
            a, b = leader.admin, follower.admin
            until_all(lambda: ready(a) and ready(b), 30, "both ready")
            for i in range(2 * rounds):
                who, victim = ("follower", follower) if i % 2 == 0 else ("leader", leader)
                os.kill(victim.sglang_pid(), signal.SIGKILL)
                down = until_all(lambda: not ready(a) and not ready(b), 10, "both 503")
                up = until_all(lambda: ready(a) and ready(b), 30, "both ready")
                out[who][0].append(down)
                out[who][1].append(down + up - LOAD_S)
    print(f"{'SIGKILL of':<22}{'-> every /readyz 503 (s)':>28}{'-> group ready (s)':>22}")
    for who, (downs, ups) in out.items():
        print(
            f"{who + ' SGLang':<22}"
            f"{statistics.median(downs):>14.2f} (max {max(downs):.2f})"
            f"{statistics.median(ups):>12.2f} (max {max(ups):.2f})"
        )
    print(f"{rounds} rounds each; stand-in load and warm-up ({LOAD_S:.1f} s) excluded")


if __name__ == "__main__":
    main()
