"""`python -m bench multinode`: a two-node replica's relaunch, simulated on one machine.

    .venv/bin/python -m bench multinode [--rounds 5]
    .venv/bin/python -m bench multinode --failed-follower [--rounds 5]
    .venv/bin/python -m bench multinode --quick --rounds 1    # the suite's form (tests/bench)

Two real daemons (`kimi-serve run`), two stand-ins in multi-node mode (rank 0 and rank 1 meet
at --dist-init-addr), loopback admin endpoints, one shared token, `group.poll_interval` 0.2 s.
Per round, one node's SGLang main process is SIGKILLed (alternately the follower's and the
leader's): the time until every node's /readyz answers 503, and until both answer 200 again,
with the stand-in's own load and warm-up (0.4 s per launch) taken out.

`--failed-follower`: the follower's simulated GPU 0 needs a reset (supervisor/gpu/sim.py), so
it goes `failed` before any launch; the leader keeps starting epochs (its backoff 0.1 s) and
each must end at once. Measured per epoch from the leader's `launching` log line (the first:
from the follower's `failed`) to its `restarting` with reason `group`. docs/benchmarks.md has
the figures.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import uuid
from pathlib import Path

from bench.common import at, parser
from supervisor.gpu.sim import ENV_GPUS, ENV_HEALTH, ENV_TAG
from testkit import running
from testkit.pair import node_configs, ready, until_all

LOAD_S = 0.3 + 0.1  # base_config: STANDIN_LOAD_SECONDS + STANDIN_WARMUP_SECONDS


def failed_follower(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        leader_cfg, follower_cfg = node_configs(tmp)
        follower_cfg["gpus"] = {"manage": True}
        (tmp / "health").write_text("0:remap_pending")
        env = {
            ENV_GPUS: "2",
            ENV_TAG: f"bench-multinode-{uuid.uuid4().hex[:12]}",
            ENV_HEALTH: f"@{tmp / 'health'}",
        }
        ends: list[float] = []
        with running(tmp / "node0", leader_cfg) as leader:
            leader.wait_state("loading")
            with running(tmp / "node1", follower_cfg, env=env) as follower:
                since = at(follower.wait_state("failed"))
                for _ in range(rounds):
                    ended = leader.wait_state("restarting", timeout=30)
                    assert ended["reason"] == "group", ended
                    ends.append(at(ended) - since)
                    since = at(leader.wait_state("launching"))
    print("a failed follower: the leader's epoch ended after (s):")
    print(" ".join(f"{e:.2f}" for e in ends))
    print(f"median {statistics.median(ends):.2f}, max {max(ends):.2f}, {rounds} epochs")


def main(argv: list[str] | None = None) -> int:
    ap = parser("multinode", __doc__, rounds=5)
    ap.add_argument("--failed-follower", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the follower's SGLang killed only")
    args = ap.parse_args(argv)
    rounds = args.rounds
    if args.failed_follower:
        failed_follower(rounds)
        return 0
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
            for i in range(0, 2 * rounds, 2 if args.quick else 1):
                who, victim = ("follower", follower) if i % 2 == 0 else ("leader", leader)
                os.kill(victim.sglang_pid(), signal.SIGKILL)
                down = until_all(lambda: not ready(a) and not ready(b), 10, "both 503")
                up = until_all(lambda: ready(a) and ready(b), 30, "both ready")
                out[who][0].append(down)
                out[who][1].append(down + up - LOAD_S)
    print(f"{'SIGKILL of':<22}{'-> every /readyz 503 (s)':>28}{'-> group ready (s)':>22}")
    for who, (downs, ups) in [(k, v) for k, v in out.items() if v[0]]:
        print(
            f"{who + ' SGLang':<22}"
            f"{statistics.median(downs):>14.2f} (max {max(downs):.2f})"
            f"{statistics.median(ups):>12.2f} (max {max(ups):.2f})"
        )
    print(f"{rounds} rounds each; stand-in load and warm-up ({LOAD_S:.1f} s) excluded")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
