"""`python -m bench downtime`: what a restart costs on real SGLang 0.5.23 (CPU), cold and warm.

    SGLANG_ENV_DIR=/path/to/env .venv/bin/python -m bench downtime [--rounds 2] [--json F]
    .venv/bin/python -m bench downtime --standin --rounds 1 --only warm-off   # the suite's form

Root only (it drops the page cache: `sync; echo 3 > /proc/sys/vm/drop_caches`). Needs the
environment of `tools/sglang-env` and a larger model made by `tools/make-large-model` (built on
the first run, ~2.5 GB, under --model-dir). Per configuration (prewarm off or auto; page cache
dropped or kept) and round: one daemon (`kimi-serve run`, testkit.DaemonProcess); its first
launch -> ready; then SIGKILL of SGLang's scheduler (the page cache dropped again first when
cold) -> ready again. From each load, /status.last_load: the total, the `weights` phase, SGLang's
own `load_weight`, the prewarm's bytes and seconds. From the crash-restart, kimi-serve's share
of the downtime (everything that is not SGLang's load, from the daemon's own log): the death
noticed (kill -> `restarting`), the old launch stopped and the backoff (-> `cleaning`), the
cleaning (-> `launching`), the readiness probe (the load's `probe` phase); and the whole
`downtime_s` of /status.last_restart. docs/benchmarks.md has the table.
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

from bench.common import REPO_ROOT, at, parser, start_daemon, state_is
from bench.real_sglang import config, scheduler_pid, sglang_env

BACKOFF_S = 5.0  # restart.backoff_initial's default


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def large_model(python: str, tiny: str, where: Path) -> Path:
    model = where / "large-model"
    if not (model / "SHA256SUMS").exists():
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [python, str(REPO_ROOT / "tools" / "make-large-model"), tiny, str(model)],
            check=True,
            timeout=1800,
        )
    return model


def _load_row(doc: dict[str, Any]) -> dict[str, float]:
    load = doc["last_load"]
    row = {
        "total_s": load["total_s"],
        "weights_s": load["phases"].get("weights"),
        "sglang_load_weight_s": load["sglang_reported"].get("load_weight"),
        "probe_s": load["phases"].get("probe"),
        "warmup_s": load["phases"].get("warmup"),
    }
    pre = load.get("prewarm")
    if pre:
        row["prewarm_bytes"] = pre["bytes"]
        row["prewarm_s"] = pre["seconds"]
        row["resident_before_bytes"] = pre["resident_before"]
    return {k: v for k, v in row.items() if v is not None}


def one_round(
    python: str, model: Path | None, prewarm: str, cold: bool, backoff: float = BACKOFF_S
) -> dict[str, Any]:
    """One daemon, its start and one crash-restart. `model` None: the SGLang stand-in."""
    with tempfile.TemporaryDirectory(prefix="bench-downtime-") as tmp:
        work = Path(tmp)
        cfg = config(work, python, str(model), standin=model is None)
        model = Path(cfg["sglang"]["model_path"])
        cfg["restart"]["backoff_initial"] = f"{backoff}s"
        cfg["restart"]["backoff_max"] = f"{backoff * 4}s"
        cfg["readiness"]["load_timeout"] = "10m"
        cfg["liveness"] = {"interval": "5s", "timeout": "30s", "failure_threshold": 3}
        cfg["warm"] = {"prewarm": prewarm, "cache_dir": str(work / "cache")}
        if cold:
            drop_page_cache()
        else:
            for f in model.iterdir():
                f.read_bytes()
        d = start_daemon(work, cfg)
        try:
            d.wait_for(state_is("ready"), 600, "ready")
            first = _load_row(d.status())
            sched = scheduler_pid(d)
            if cold:
                drop_page_cache()
            killed_at = time.time()
            os.kill(sched, signal.SIGKILL)
            restarting = d.wait_for(state_is("restarting"), 120, "restarting")
            cleaning = d.wait_for(state_is("cleaning"), 120, "cleaning")
            launching = d.wait_for(state_is("launching"), 120, "launching")
            d.wait_for(state_is("ready"), 600, "ready again")
            doc = d.status()
            again = _load_row(doc)
            # The probe's own span is SGLang decoding its tokens (seconds for this model on a
            # loaded CPU): reported, not counted. What kimi-serve adds there is the wait from
            # the port opening to the probe's start, the `warmup` phase when the probe passes
            # before SGLang's own ready line (0.5.23 on a CPU, loadphases.py).
            share = {
                "death_noticed_s": at(restarting) - killed_at,
                "stop_and_backoff_s": at(cleaning) - at(restarting),
                "cleaning_s": at(launching) - at(cleaning),
                "port_to_probe_s": again.get("warmup_s", 0.0),
            }
            share["kimi_serve_share_s"] = sum(share.values())
            share["beyond_backoff_s"] = share["kimi_serve_share_s"] - backoff
            share["probe_decode_s"] = again.get("probe_s", 0.0)
            return {
                "prewarm": prewarm,
                "cold": cold,
                "start": first,
                "restart": again,
                "downtime_s": doc["last_restart"]["downtime_s"],
                "share": share,
                "loadavg": os.getloadavg(),
            }
        finally:
            d.stop(60)


CONFIGS = (("off", True), ("auto", True), ("off", False), ("auto", False))


def label(prewarm: str, cold: bool) -> str:
    return f"{'cold' if cold else 'warm'}, prewarm {prewarm}"


def table(rounds: list[dict[str, Any]]) -> str:
    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):7.2f}" if xs else "      -"

    out = [
        "| page cache, prewarm | launch | total s | weights s | SGLang load_weight s | "
        "prewarm GiB / s | downtime s |",
        "|---|---|---|---|---|---|---|",
    ]
    for prewarm, cold in CONFIGS:
        done = [r for r in rounds if r["prewarm"] == prewarm and r["cold"] == cold]
        if not done:
            continue
        for kind in ("start", "restart"):
            rows = [r[kind] for r in done]
            pre = [r.get("prewarm_bytes", 0) / 2**30 for r in rows]
            pre_s = [r.get("prewarm_s", 0.0) for r in rows]
            down = [r["downtime_s"] for r in done] if kind == "restart" else []
            out.append(
                f"| {label(prewarm, cold)} | {kind} | {med([r['total_s'] for r in rows])} | "
                f"{med([r.get('weights_s', 0.0) for r in rows])} | "
                f"{med([r.get('sglang_load_weight_s', 0.0) for r in rows])} | "
                f"{statistics.median(pre):.2f} / {statistics.median(pre_s):.1f} | {med(down)} |"
            )
    shares = [r["share"] for r in rounds]
    out.append("")
    out.append(f"kimi-serve's share of a crash-restart's downtime (median of {len(shares)}):")
    for key in shares[0]:
        out.append(f"  {key:<22} {statistics.median(s[key] for s in shares):7.3f} s")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = parser("downtime", __doc__, rounds=2, json_out=True)
    ap.add_argument("--model-dir", type=Path, default=Path("/var/tmp/kimi-serve-bench"))
    only = "comma-separated: cold-off,cold-auto,warm-off,warm-auto"
    ap.add_argument("--only", default="", help=only)
    standin = "the SGLang stand-in, backoff 0.5 s (the suite's form: --only warm-off needs no root)"
    ap.add_argument("--standin", action="store_true", help=standin)
    args = ap.parse_args(argv)
    wanted = set(filter(None, args.only.split(",")))
    if os.geteuid() != 0 and not (wanted and all(w.startswith("warm") for w in wanted)):
        print("python -m bench downtime: root is needed to drop the page cache", file=sys.stderr)
        return 2
    model: Path | None = None
    backoff = BACKOFF_S
    if args.standin:
        python, backoff = sys.executable, 0.5
    else:
        python, tiny = sglang_env()
        model = large_model(python, tiny, args.model_dir)
    rounds: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for prewarm, cold in CONFIGS:
            if wanted and f"{'cold' if cold else 'warm'}-{prewarm}" not in wanted:
                continue
            rounds.append(one_round(python, model, prewarm, cold, backoff))
            print(json.dumps(rounds[-1]), flush=True)
    if model is not None:
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print(f"model: {model} ({size / 2**30:.2f} GiB of safetensors), backoff {backoff} s")
    print(f"load average before {load_before}, after {os.getloadavg()}")
    print(table(rounds))
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "load_before": load_before}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
