"""`python -m bench real-sglang`: kimi-serve's rows on the real SGLang 0.5.23 server (CPU).

    SGLANG_ENV_DIR=/path/to/env .venv/bin/python -m bench real-sglang [--rounds 3] [--json F]
    .venv/bin/python -m bench real-sglang --standin --rounds 1    # the suite's form

Needs the environment of `tools/sglang-env` (real SGLang, stock torch, the tiny model) and the
name-only `sgl_kernel` of tools/sglang-env.d. Per round: one launch of the real daemon
(`kimi-serve run`, testkit.DaemonProcess: its JSON log lines as they are printed) on the real
server; launch -> ready; the readiness lag from the port opening (warming: our decode probe
after SGLang's port answers) and from SGLang's own "ready to roll" line; SIGKILL of the real
scheduler -> /readyz 503 and -> ready again. `python -m bench --real-sglang` adds these rows to
the main bench. docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import REPO_ROOT, at, parser, start_daemon, state_is
from supervisor.sglang.logscan import READY_LINE
from testkit import DaemonProcess, base_config, free_port
from testkit.sglang_cpu import CPU_ARGS


def sglang_env() -> tuple[str, str]:
    """(interpreter, tiny model) from tools/sglang-env (which builds them if needed)."""
    out = []
    for flag in ([], ["--model"]):
        argv = [str(REPO_ROOT / "tools" / "sglang-env"), *flag]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=True)
        out.append(done.stdout.strip().splitlines()[-1])
    return out[0], out[1]


def config(work: Path, python: str, model: str, standin: bool = False) -> dict[str, Any]:
    """The daemon's config for the real server; with `standin`, for the SGLang stand-in (the
    suite's form: the same steps in seconds)."""
    cfg: dict[str, Any] = {
        "sglang": {
            "python": python,
            "module": "sglang.launch_server",
            "model_path": model,
            "host": "127.0.0.1",
            "port": free_port(),
            "args": CPU_ARGS,
            "env": {
                "SGLANG_USE_CPU_ENGINE": "1",
                "CUDA_VISIBLE_DEVICES": "",
                "PYTHONPATH": str(REPO_ROOT / "tools" / "sglang-env.d"),
                "SPT_NOENV": "1",
                "SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION": "1",
            },
        },
        "readiness": {"load_timeout": "5m", "probe": {"max_tokens": 8, "timeout": "30s"}},
        "liveness": {"interval": "1s", "timeout": "2s", "failure_threshold": 2},
        "restart": {
            "backoff_initial": "0.2s",
            "backoff_max": "1s",
            "fallback_profile": None,
            "crash_loop": {"max_restarts": 20, "window": "1h"},
        },
        "stop": {"drain_timeout": "20s"},
        "gpus": {"manage": False},
        "admin": {"listen": f"127.0.0.1:{free_port()}"},
        "state_dir": str(work / "state"),
        # info: SGLang's lines come through, the "ready to roll" one with its time.
        "logging": {"format": "json", "level": "info"},
    }
    if standin:
        cfg["sglang"] = base_config(work)["sglang"]
    return cfg


def scheduler_pid(d: DaemonProcess) -> int:
    """SGLang's (first) scheduler process of the daemon's current launch."""
    return next(
        p
        for p in d.status()["child"]["processes"]
        if " ".join(psutil.Process(p).cmdline()).startswith("sglang::scheduler")
    )


def one_round(python: str, model: str, standin: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        work = Path(tmp)
        d = start_daemon(work, config(work, python, model, standin))
        try:
            loading = d.wait_for(state_is("loading"), 120, "loading")
            warming = d.wait_for(state_is("warming"), 300, "warming")
            ready = d.wait_for(state_is("ready"), 300, "ready")
            # Our probe usually passes before SGLang's warmup prints its line: wait for it.
            rolled = [e for e in d.seen if READY_LINE in str(e.get("event"))] or [
                d.wait_for(lambda e: READY_LINE in str(e.get("event")), 120, "ready line")
            ]
            sched = scheduler_pid(d)
            with httpx.Client(trust_env=False) as client:
                t0 = time.monotonic()
                killed_at = time.time()
                os.kill(sched, signal.SIGKILL)
                while client.get(d.admin + "/readyz", timeout=5).status_code == 200:
                    pass
                to_503 = time.monotonic() - t0
            again = d.wait_for(state_is("ready"), 300, "ready again")
            row = {
                "launch_to_ready_s": at(ready) - at(loading),
                "readiness_lag_from_port_s": at(ready) - at(warming),
                "scheduler_kill_to_readyz_503_s": to_503,
                "scheduler_kill_to_ready_again_s": at(again) - killed_at,
            }
            # Negative: kimi-serve was ready before SGLang's own warmup said so.
            row["readiness_lag_from_ready_line_s"] = at(ready) - at(rolled[0])
            return row
        finally:
            d.stop(60)


def rows(rounds: int, standin: bool = False) -> list[dict[str, float]]:
    python, model = (sys.executable, "") if standin else sglang_env()
    return [one_round(python, model, standin) for _ in range(rounds)]


def summarise(done: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    keys = list(dict.fromkeys(k for r in done for k in r))  # in the order measured
    return {
        k: {
            "median": statistics.median(r[k] for r in done if k in r),
            "max": max(r[k] for r in done if k in r),
        }
        for k in keys
    }


def table(
    summary: dict[str, dict[str, float]], rounds: int, server: str = "real SGLang 0.5.23"
) -> str:
    out = [f"{'figure':<36} {'median':>9} {'max':>9}   ({rounds} rounds, {server})"]
    for k, v in summary.items():
        out.append(f"{k:<36} {v['median']:>9.3f} {v['max']:>9.3f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = parser("real-sglang", __doc__, rounds=3, json_out=True)
    standin = "the SGLang stand-in instead (the suite's form)"
    ap.add_argument("--standin", action="store_true", help=standin)
    args = ap.parse_args(argv)
    done = rows(args.rounds, args.standin)
    summary = summarise(done)
    print(table(summary, args.rounds, "the stand-in" if args.standin else "real SGLang 0.5.23"))
    if args.json:
        args.json.write_text(json.dumps({"rounds": done, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
