"""What the stack dump before the kill adds to time-to-restart, through the real daemon
(docs/benchmarks.md, "Stack dumps in the restart"):

    .venv/bin/python -m bench incident-restart [--rounds 3]     # about 60 s
    .venv/bin/python -m bench incident-restart --quick          # 1 round, real py-spy only

`kimi-serve run` supervises the stand-in (`--tp-size 2`) with its decode-hang fault on every
launch, so each launch is restarted for `liveness_failed`. Per restart it takes the time from the
daemon's `restarting` to its `cleaning` (the launch dumped, killed and gone), from the daemon's
own log timestamps, with: the real py-spy; no py-spy at all (no dump: the kill alone); and a
py-spy that hangs (the whole `incidents.dump_timeout`, 2 s here).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import parser
from testkit.incidents import hang_config, restart_seconds
from testkit.shadow import shadow_python, start_with

BUDGET = "2s"


def measure(py_spy: str | None, rounds: int) -> list[float]:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        cfg = hang_config(tmp, BUDGET)
        del cfg["sglang"]["env"]["STANDIN_FAULT_LAUNCH"]  # every launch hangs
        cfg["restart"]["crash_loop"]["max_restarts"] = rounds + 5
        with start_with(tmp, cfg, shadow_python(tmp, py_spy)) as d:
            out = []
            for _ in range(rounds):
                d.wait_state("ready", 60)
                out.append(restart_seconds(d))
            return out


def main(argv: list[str] | None = None) -> int:
    p = parser("incident-restart", __doc__, rounds=3)
    p.add_argument("--quick", action="store_true", help="one round with the real py-spy only")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds = 1
    real = Path(sys.executable).parent / "py-spy"
    cases = {
        "real py-spy (stacks taken)": f'exec {real} "$@"\n',
        "no py-spy (no dump, the kill alone)": None,
        f"py-spy that hangs (budget {BUDGET})": "exec sleep 600\n",
    }
    if a.quick:
        cases = dict(list(cases.items())[:1])
    print(f"restarting -> cleaning, seconds, {a.rounds} liveness restarts each:")
    for name, body in cases.items():
        times = measure(body, a.rounds)
        shown = ", ".join(f"{x:.2f}" for x in times)
        print(f"  {statistics.median(times):6.2f} median  ({shown})  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
