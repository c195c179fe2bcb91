"""`python -m bench handoff`: a hand-over (`POST /reexec`) against a restart (`POST /restart`),
under a client loop, on real SGLang 0.5.23 (CPU) or the stand-in.

    SGLANG_ENV_DIR=/path/to/env .venv/bin/python -m bench handoff [--rounds 2] [--json F]
    .venv/bin/python -m bench handoff --standin --rounds 1      # the suite's form

Per round: one daemon (`kimi-serve run`), ready; a client loop (testkit.handover.Hammer) asks
`/readyz` on a new connection each time and sends a request to SGLang between them; then
`POST /reexec` → the new daemon's `hand-over complete` (its own `seconds`: from the exec to the
adopted launch's first decode), and `POST /restart` → `ready` again. For each: the wall time
from the request to ready again, the client's `/readyz` answers that were not 200 (a refused
connection among them), the requests to SGLang that failed, and the slowest `/readyz` answer.
docs/benchmarks.md has the table.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import parser, start_daemon
from bench.real_sglang import config, sglang_env
from testkit.daemon import DaemonProcess
from testkit.handover import Hammer
from testkit.wait import wait_until

LOAD_S = 300.0


def _under_load(d: DaemonProcess, sglang: str, act: str) -> dict[str, float | None]:
    with Hammer(d.admin, sglang) as h:
        wait_until(lambda: h.sent > 10, 60, "the client loop running")
        began = time.monotonic()
        assert d.post(f"/{act}").status_code == 202
        if act == "reexec":
            done = d.wait_for(lambda e: e.get("event") == "hand-over complete", LOAD_S)
            exec_to_ready: float | None = float(done["seconds"])
        else:
            d.wait_state("restarting", LOAD_S)
            d.wait_state("ready", LOAD_S)
            exec_to_ready = None
        took = time.monotonic() - began
        after = h.sent
        wait_until(lambda: h.sent > after + 5, 60, "the client loop after")
    return {
        "request_to_ready_s": round(took, 3),
        "exec_to_ready_s": exec_to_ready,
        "readyz_not_200": float(sum(n for code, n in h.codes.items() if code != "200")),
        "sglang_failed": float(h.failed),
        "slowest_readyz_s": round(h.slowest_s, 3),
        "requests": float(h.sent),
    }


Row = dict[str, float | None]


def one_round(python: str, model: str, standin: bool) -> dict[str, Row]:
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as tmp:
        cfg = config(Path(tmp), python, model, standin=standin)
        d = start_daemon(Path(tmp), cfg)
        try:
            d.wait_state("ready", LOAD_S)
            sglang = f"http://127.0.0.1:{cfg['sglang']['port']}"
            return {act: _under_load(d, sglang, act) for act in ("reexec", "restart")}
        finally:
            d.stop()


def _median(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):>22.3f}" if known else f"{'-':>22}"


def table(rounds: list[dict[str, Row]], what: str) -> str:
    cols = (
        "request_to_ready_s",
        "exec_to_ready_s",
        "readyz_not_200",
        "sglang_failed",
        "slowest_readyz_s",
    )
    lines = [f"hand-over vs restart on {what}, {len(rounds)} rounds (median)"]
    lines.append(f"{'':10}" + "".join(f"{c:>22}" for c in cols))
    for act in ("reexec", "restart"):
        lines.append(f"{act:10}" + "".join(_median([r[act][c] for r in rounds]) for c in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser("handoff", __doc__, rounds=2, json_out=True)
    ap.add_argument("--standin", action="store_true", help="the SGLang stand-in instead")
    args = ap.parse_args(argv)
    python, model = (sys.executable, "") if args.standin else sglang_env()
    done = [one_round(python, model, args.standin) for _ in range(args.rounds)]
    print(table(done, "the stand-in" if args.standin else "real SGLang 0.5.23"))
    if args.json:
        args.json.write_text(json.dumps({"rounds": done}, indent=2))
    ok = all(r["reexec"]["readyz_not_200"] == 0 and r["reexec"]["sglang_failed"] == 0 for r in done)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
