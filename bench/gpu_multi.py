"""GPU hygiene and fitness across several GPUs (2 or more), as tensor parallel runs them.

On a machine with N >= 2 NVIDIA GPUs and torch:

1. Fitness read and the critical-event set on every GPU (fields as the driver reports them).
2. A daemon crash with tp N: one orphan per GPU 0..N-1 allocating with torch, its command line
   ending in `sglang::scheduler_TP<i>`, every one carrying the daemon's owner marker; the even
   ones also named in the launch record; one more orphan found only by NVML and `gpus.match`
   (`launch_server`) on the last GPU; and a foreign process on GPU 1. Two of the schedulers
   (GPUs 0 and 1) first run a real NCCL all-reduce between them (NCCL_NVLS_ENABLE=0: NVLink
   multicast stays off) and keep their communicator. Each holder is pinned with
   CUDA_VISIBLE_DEVICES=<its UUID>; `gpus.devices` lists the UUIDs in reverse NVML order (the
   order a reordering CUDA_VISIBLE_DEVICES would give), so selection by UUID is what is proved.
   Cleaning: `gpu.sweep_leftovers()` then `gpu.clean()`, counted per GPU; a sampler thread
   records, per GPU, when its memory came back. The foreign process must survive.
3. A GPU outside `gpus.devices` is never touched: devices = GPU 0 only, a matching process on
   the last GPU must survive `gpu.clean()`.

    python -m bench gpu-multi --out $OUT          # needs >= 2 GPUs
    python -m bench gpu-multi --simulated         # anywhere: 4 simulated GPUs, no torch/NCCL

Writes gpu_multi.json to --out and prints the per-GPU table; exit 0 when every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

from bench import common
from supervisor import gpu
from supervisor.config import GpusConfig
from supervisor.gpu import fitness, fitness_watch
from supervisor.gpu.sim import open_nvml
from supervisor.metrics import Metrics
from supervisor.process import ProcessOwner
from supervisor.process.identity import OWNER_ENV, LaunchRecord, RecordStore, live_process
from supervisor.threads import in_thread
from testkit import free_port


async def main_async(args: argparse.Namespace) -> int:
    env = common.simulate_gpus(4) if args.simulated else dict(os.environ)
    env["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off
    nvml = open_nvml()
    snaps = nvml.snapshot()
    n = len(snaps)
    if n < 2:
        print(f"error: {n} GPU(s) here; this bench needs 2 or more", file=sys.stderr)
        return 2
    uuids = {s.index: s.uuid for s in snaps}
    out: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "gpus": [{"index": s.index, "uuid": s.uuid, "name": s.name} for s in snaps],
        "simulated": args.simulated,
    }
    if not args.simulated:
        import pynvml

        out["driver"] = str(pynvml.nvmlSystemGetDriverVersion())

    # 1. Fitness and events on every GPU.
    reads = await fitness_watch.read(nvml, "all")
    report = fitness.assess_all(reads)
    out["health"] = [f.health() for f in report.gpus]
    events = await in_thread(nvml.open_events, 10.0)
    t = time.monotonic()
    await in_thread(lambda: events.wait(1000), 12.0)
    out["event_wait_1000ms_s"] = round(time.monotonic() - t, 4)
    out["events_registered"] = {str(k): v for k, v in getattr(events, "registered", {}).items()}
    events.close()

    # 2. The crash across every GPU.
    holder, state, marker, _work = common.scene("kimi-multi-bench-")
    port = str(free_port())

    def job(
        i: int, gib: float, title: list[str], ours: bool, nccl_rank: int | None = None
    ) -> tuple[list[str], dict[str, str]]:
        argv = common.holder_argv(holder, gib, title, "nccl" if nccl_rank is not None else "-", i)
        e = {"CUDA_VISIBLE_DEVICES": uuids[i], "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        if ours:
            e[OWNER_ENV] = marker
        if nccl_rank is not None:
            e.update(BENCH_RANK=str(nccl_rank), BENCH_WORLD="2", BENCH_PORT=port)
        return argv, e

    nccl = not args.simulated  # the all-reduce between GPUs 0 and 1
    jobs = [
        job(i, args.gib, [f"sglang::scheduler_TP{i}"], True, i if i < 2 and nccl else None)
        for i in range(n)
    ]
    jobs.append(job(n - 1, args.gib / 2, ["launch_server", "--tp-size", str(n)], False))
    jobs.append(job(1, 0.25, ["trainer", "--epochs", "1"], False))
    started = time.monotonic()
    held: list[common.Held] = common.launch_orphans(jobs, env, timeout=300)
    out["holders_ready_s"] = round(time.monotonic() - started, 2)
    idents = {i: h.ident for i, h in enumerate(held)}
    foreign = idents[n + 1]
    out["nccl_all_reduce"] = {str(i): held[i].result for i in (0, 1)}  # expect "3" each on GPUs
    try:
        recorded = tuple(idents[i] for i in range(0, n, 2))
        RecordStore(str(state)).save(LaunchRecord(2**22 + 1, "primary", recorded))
        before = {s.index: round(s.memory_used_bytes / common.MiB) for s in nvml.snapshot()}

        def read() -> dict[int, int]:
            return {s.index: s.memory_used_bytes for s in nvml.snapshot()}

        sampler = common.Sampler(read)
        t0 = time.monotonic()
        owner = ProcessOwner(marker, lambda _l, _s, _x: None, lambda _c: None)
        sweep = await gpu.sweep_leftovers(
            owner.sweep, nvml, set(recorded), set(owner.marked_processes())
        )
        devices = tuple(uuids[i] for i in sorted(uuids, reverse=True))
        cfg = GpusConfig(True, devices, "kill-matching", ("sglang", "launch_server"), 60.0, 2048)
        clean = await gpu.clean(cfg, nvml, current=set(), recorded=set(), owner=marker)
        await asyncio.sleep(0.3)
        sampler.stop()
        metrics = Metrics()
        metrics.count_leftovers(sweep.killed_rows())
        metrics.count_leftovers(clean.killed_rows())
        per_gpu = []
        for i in range(n):
            final = sampler.samples[-1][1][i]
            back = sampler.first(t0, lambda g, i=i, final=final: g[i] <= final + 64 * common.MiB)
            counted = metrics.registry.get_sample_value(
                "kimi_serve_gpu_leftover_processes_killed_total", {"gpu": str(i), "UUID": uuids[i]}
            )
            per_gpu.append(
                {
                    "gpu": i,
                    "uuid": uuids[i],
                    "used_mib_before": before[i],
                    "used_mib_after": round(final / common.MiB),
                    "memory_back_s": back,
                    "leftovers_counted": counted,
                }
            )
        out["crash"] = {
            "sweep": sweep.to_dict(),
            "clean_ok": clean.ok,
            "clean_message": clean.message,
            "status_leftovers": gpu.leftover_status(sweep, clean),
            "per_gpu": per_gpu,
            "foreign_alive": live_process(foreign) is not None,
            "ours_alive": [i for i in range(n + 1) if live_process(idents[i]) is not None],
        }

        # 3. A GPU outside gpus.devices is never touched.
        (outside,) = common.launch_orphans(
            [job(n - 1, 0.25, ["launch_server", "--port", "30001"], False)], env, timeout=120
        )
        outside_ident = idents[-1] = outside.ident
        cfg0 = GpusConfig(True, (0,), "kill-matching", ("sglang", "launch_server"), 10.0, 2048)
        only0 = await gpu.clean(cfg0, nvml, current=set(), recorded=set(), owner=marker)
        out["outside"] = {
            "gpu": n - 1,
            "clean_ok": only0.ok,
            "found": [c.pid for c in only0.found],
            "alive": live_process(outside_ident) is not None,
        }
    finally:
        common.kill_held([common.Held(i, "", 0) for i in idents.values()])
        nvml.close()

    c = out["crash"]
    checks = {
        "every GPU fit": report.ok,
        "event wait returned on time": 0.95 <= out["event_wait_1000ms_s"] <= 1.5,
        "NCCL all-reduce ran": args.simulated or out["nccl_all_reduce"] == {"0": "3", "1": "3"},
        "clean ok on every managed GPU": c["clean_ok"],
        "a leftover counted on every GPU": all(
            (g["leftovers_counted"] or 0) >= 1 for g in c["per_gpu"]
        ),
        "memory back on every GPU": all(g["memory_back_s"] is not None for g in c["per_gpu"]),
        "foreign survived": c["foreign_alive"],
        "no leftover survived": c["ours_alive"] == [],
        "GPU outside gpus.devices untouched": out["outside"]["alive"]
        and out["outside"]["found"] == [],
    }
    out["checks"] = checks
    common.write_json(args.out, "gpu_multi.json", out)
    print(f"{n} GPUs, driver {out.get('driver', '-')}; holders ready in {out['holders_ready_s']}s")
    print(f"{'GPU':<4} {'UUID':<42} {'MiB before':>10} {'after':>6} {'back s':>7} {'counted':>7}")
    for g in c["per_gpu"]:
        print(
            f"{g['gpu']:<4} {g['uuid']:<42} {g['used_mib_before']:>10} {g['used_mib_after']:>6} "
            f"{g['memory_back_s'] if g['memory_back_s'] is not None else '-':>7} "
            f"{g['leftovers_counted']!s:>7}"
        )
    print(c["sweep"]["message"])
    print(c["clean_message"])
    return common.verdict(checks)


def main(argv: list[str] | None = None) -> int:
    ap = common.gpu_args("gpu-multi", __doc__ or "", "GiB each scheduler allocates", index=False)
    return common.run_gpu_bench(main_async, ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
