"""`python -m bench.real_sglang`: kimi-serve's rows on the real SGLang 0.5.23 server (CPU).

    SGLANG_ENV_DIR=/path/to/env .venv/bin/python -m bench.real_sglang [--rounds 3] [--json F]

Needs the environment of `tools/sglang-env` (real SGLang, stock torch, the tiny model) and the
name-only `sgl_kernel` of tools/sglang-env.d. Per round: one launch of the real daemon
(`kimi-serve run`) on the real server; launch -> ready; the readiness lag from the port opening
(our decode probe after SGLang's port answers); SIGKILL of the real scheduler -> /readyz 503
and -> ready again. docs/benchmarks.md has the figures.
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
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from bench.common import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).with_name("kimi-serve")
CPU_ARGS: dict[str, Any] = {
    "device": "cpu",
    "attention-backend": "torch_native",
    "disable-cuda-graph": True,
    "max-total-tokens": 16384,
    "sleep-on-idle": True,
    "enable-metrics": True,
    "tp-size": 1,
}


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
        "logging": {"format": "json", "level": "warning"},
    }


def _status(admin: str) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = httpx.get(admin + "/status", timeout=5).json()
        return doc
    except (httpx.HTTPError, ValueError):
        return None


def _wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _event_at(status: dict[str, Any], to: str, after: float = 0.0) -> float | None:
    times = [e["at"] for e in status["events"] if e["to"] == to and e["at"] > after]
    return times[-1] if times else None


def one_round(python: str, model: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        work = Path(tmp)
        cfg = config(work, python, model)
        path = work / "kimi-serve.yaml"
        path.write_text(yaml.safe_dump(cfg))
        admin = f"http://{cfg['admin']['listen']}"
        daemon = subprocess.Popen(
            [str(BIN), "run", "--config", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            st = _wait(lambda: (s := _status(admin)) and s["state"] == "ready" and s, 300, "ready")
            launched, warming, ready = (_event_at(st, x) for x in ("loading", "warming", "ready"))
            assert launched and warming and ready
            sched = next(
                p
                for p in st["child"]["processes"]
                if psutil.Process(p).cmdline()[:1] == ["sglang::scheduler"]
            )
            with httpx.Client() as client:
                t0 = time.monotonic()
                killed_at = time.time()
                os.kill(sched, signal.SIGKILL)
                while client.get(admin + "/readyz", timeout=5).status_code == 200:
                    pass
                to_503 = time.monotonic() - t0
            again = _wait(
                lambda: (s := _status(admin)) and _event_at(s, "ready", killed_at), 300, "again"
            )
            return {
                "launch_to_ready_s": ready - launched,
                "readiness_lag_from_port_s": ready - warming,
                "scheduler_kill_to_readyz_503_s": to_503,
                "scheduler_kill_to_ready_again_s": again - killed_at,
            }
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.real_sglang")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    python, model = sglang_env()
    rows = [one_round(python, model) for _ in range(args.rounds)]
    summary = {
        k: {"median": statistics.median(r[k] for r in rows), "max": max(r[k] for r in rows)}
        for k in rows[0]
    }
    print(f"{'figure':<36} {'median':>9} {'max':>9}   ({args.rounds} rounds, real SGLang 0.5.23)")
    for k, v in summary.items():
        print(f"{k:<36} {v['median']:>9.3f} {v['max']:>9.3f}")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
