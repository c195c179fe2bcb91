"""`python -m bench.real_sglang`: kimi-serve's rows on the real SGLang 0.5.23 server (CPU).

    SGLANG_ENV_DIR=/path/to/env .venv/bin/python -m bench.real_sglang [--rounds 3] [--json F]

Needs the environment of `tools/sglang-env` (real SGLang, stock torch, the tiny model) and the
name-only `sgl_kernel` of tools/sglang-env.d. Per round: one launch of the real daemon
(`kimi-serve run`, testkit.DaemonProcess: its JSON log lines as they are printed) on the real
server; launch -> ready; the readiness lag from the port opening (warming: our decode probe
after SGLang's port answers) and from SGLang's own "ready to roll" line; SIGKILL of the real
scheduler -> /readyz 503 and -> ready again. `python -m bench --real-sglang` adds these rows to
the main bench. docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from supervisor.sglang.logscan import READY_LINE
from testkit import DaemonProcess, free_port
from testkit.sglang_cpu import CPU_ARGS

REPO = Path(__file__).resolve().parents[1]


def sglang_env() -> tuple[str, str]:
    """(interpreter, tiny model) from tools/sglang-env (which builds them if needed)."""
    out = []
    for flag in ([], ["--model"]):
        done = subprocess.run(
            [str(REPO / "tools" / "sglang-env"), *flag],
            capture_output=True,
            text=True,
            timeout=1800,
            check=True,
        )
        out.append(done.stdout.strip().splitlines()[-1])
    return out[0], out[1]


def config(work: Path, python: str, model: str) -> dict[str, Any]:
    return {
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
                "PYTHONPATH": str(REPO / "tools" / "sglang-env.d"),
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


def _at(event: dict[str, Any]) -> float:
    """Unix time of one of the daemon's JSON log lines."""
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def _is_state(to: str) -> Any:
    return lambda e: e.get("event") == "state" and e.get("new") == to


def one_round(python: str, model: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        work = Path(tmp)
        cfg = config(work, python, model)
        path = work / "kimi-serve.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        d = DaemonProcess.start(path, cfg, env)
        try:
            loading = d.wait_for(_is_state("loading"), 120, "loading")
            warming = d.wait_for(_is_state("warming"), 300, "warming")
            ready = d.wait_for(_is_state("ready"), 300, "ready")
            # Our probe usually passes before SGLang's warmup prints its line: wait for it.
            rolled = [e for e in d.seen if READY_LINE in str(e.get("event"))] or [
                d.wait_for(lambda e: READY_LINE in str(e.get("event")), 120, "ready line")
            ]
            sched = next(
                p
                for p in d.status()["child"]["processes"]
                if " ".join(psutil.Process(p).cmdline()).startswith("sglang::scheduler")
            )
            with httpx.Client(trust_env=False) as client:
                t0 = time.monotonic()
                killed_at = time.time()
                os.kill(sched, signal.SIGKILL)
                while client.get(d.admin + "/readyz", timeout=5).status_code == 200:
                    pass
                to_503 = time.monotonic() - t0
            again = d.wait_for(_is_state("ready"), 300, "ready again")
            row = {
                "launch_to_ready_s": _at(ready) - _at(loading),
                "readiness_lag_from_port_s": _at(ready) - _at(warming),
                "scheduler_kill_to_readyz_503_s": to_503,
                "scheduler_kill_to_ready_again_s": _at(again) - killed_at,
            }
            # Negative: kimi-serve was ready before SGLang's own warmup said so.
            row["readiness_lag_from_ready_line_s"] = _at(ready) - _at(rolled[0])
            return row
        finally:
            d.stop(60)


def rows(rounds: int) -> list[dict[str, float]]:
    python, model = sglang_env()
    return [one_round(python, model) for _ in range(rounds)]


def summarise(done: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    keys = list(dict.fromkeys(k for r in done for k in r))  # in the order measured
    return {
        k: {
            "median": statistics.median(r[k] for r in done if k in r),
            "max": max(r[k] for r in done if k in r),
        }
        for k in keys
    }


def table(summary: dict[str, dict[str, float]], rounds: int) -> str:
    out = [f"{'figure':<36} {'median':>9} {'max':>9}   ({rounds} rounds, real SGLang 0.5.23)"]
    for k, v in summary.items():
        out.append(f"{k:<36} {v['median']:>9.3f} {v['max']:>9.3f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.real_sglang")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    done = rows(args.rounds)
    summary = summarise(done)
    print(table(summary, args.rounds))
    if args.json:
        args.json.write_text(json.dumps({"rounds": done, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
