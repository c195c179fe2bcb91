#!/usr/bin/env python3
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

    python3 bench/gpu_multi.py --out $OUT          # needs >= 2 GPUs
    python3 bench/gpu_multi.py --simulated         # anywhere: 4 simulated GPUs, no torch/NCCL

Writes gpu_multi.json to --out and prints the per-GPU table; exit 0 when every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_run import run, scene, verdict  # noqa: E402
from supervisor import gpu  # noqa: E402
from supervisor.config import GpusConfig  # noqa: E402
from supervisor.gpu import fitness, fitness_watch  # noqa: E402
from supervisor.gpu.nvml import MiB, NvmlUnavailable  # noqa: E402
from supervisor.gpu.sim import open_nvml  # noqa: E402
from supervisor.metrics import Metrics  # noqa: E402
from supervisor.process import ProcessOwner  # noqa: E402
from supervisor.process.identity import (  # noqa: E402
    OWNER_ENV,
    LaunchRecord,
    ProcessIdentity,
    RecordStore,
    identity_of,
    live_process,
    signal_identity,
)
from supervisor.threads import in_thread  # noqa: E402

# argv: GIB NCCL(0|1) TITLE...; env RANK/WORLD/PORT for NCCL. Reports "pid result" on
# BENCH_READY_FD once its memory is taken (and the all-reduce done).
HOLDER = r"""
import os, signal, sys
gib, nccl = float(sys.argv[1]), sys.argv[2] == "1"
result = "-"
if not os.environ.get("KIMI_SERVE_SIMULATED_GPUS"):
    import torch
    if nccl:
        import torch.distributed as dist
        rank, world = int(os.environ["BENCH_RANK"]), int(os.environ["BENCH_WORLD"])
        dist.init_process_group(
            "nccl", init_method="tcp://127.0.0.1:" + os.environ["BENCH_PORT"],
            rank=rank, world_size=world, device_id=torch.device("cuda", 0))
        t = torch.full((1 << 20,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        result = "%g" % t[0].item()
    if gib > 0:
        x = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
fd = int(os.environ["BENCH_READY_FD"])
os.write(fd, ("%d %s\n" % (os.getpid(), result)).encode())
os.close(fd)
while True:
    signal.pause()
"""
# Starts each [argv, env] in a session of its own and exits: the holders become orphans.
LAUNCHER = r"""
import json, os, subprocess, sys
fd = int(os.environ["BENCH_READY_FD"])
for argv, env in json.loads(sys.argv[1]):
    subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True, pass_fds=(fd,),
                     stdin=subprocess.DEVNULL)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def launch(
    jobs: list[tuple[list[str], dict[str, str]]], env: dict[str, str], timeout: float
) -> dict[int, tuple[ProcessIdentity, str]]:
    """Start every job as an orphan; job index -> (identity, what it reported)."""
    r, w = os.pipe()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, json.dumps(jobs)],
        env={**env, "BENCH_READY_FD": str(w)},
        pass_fds=(w,),
    )
    os.close(w)
    launcher.wait()
    got: dict[int, str] = {}
    buf = b""
    deadline = time.monotonic() + timeout
    with os.fdopen(r, "rb", buffering=0) as pipe:
        while len(got) < len(jobs):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                raise RuntimeError(f"only {len(got)} of {len(jobs)} holders became ready")
            chunk = pipe.read(4096)
            if not chunk:
                raise RuntimeError(f"holders exited early: {len(got)} of {len(jobs)} ready")
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                pid, result = line.decode().split()
                got[int(pid)] = result
    import psutil

    out = {}
    for pid, result in got.items():
        cmd = psutil.Process(pid).cmdline()
        index = next(i for i, (argv, _e) in enumerate(jobs) if argv == cmd)
        ident = identity_of(pid)
        assert ident is not None
        out[index] = (ident, result)
    return out


class Sampler(threading.Thread):
    """NVML every 10 ms on its own: per GPU, used memory and listed pids."""

    def __init__(self, nvml: Any) -> None:
        super().__init__(daemon=True)
        self.nvml = nvml
        self.samples: list[tuple[float, dict[int, tuple[int, frozenset[int]]]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(NvmlUnavailable):
                snaps = self.nvml.snapshot()
                self.samples.append(
                    (
                        time.monotonic(),
                        {
                            s.index: (s.memory_used_bytes, frozenset(p.pid for p in s.processes))
                            for s in snaps
                        },
                    )
                )
            self.stop.wait(0.01)


async def main_async(args: argparse.Namespace) -> int:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off
    if args.simulated:
        env.update(
            KIMI_SERVE_SIMULATED_GPUS="4",
            KIMI_SERVE_SIM_TAG=f"bench-{uuid.uuid4().hex[:8]}",
            KIMI_SERVE_SIMULATED_GPU_MIB="1024",
        )
        os.environ.update(env)
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
    holder, state, marker = scene("kimi-multi-bench-", HOLDER)
    port = str(free_port())

    def job(
        i: int, gib: float, title: list[str], ours: bool, nccl_rank: int | None = None
    ) -> tuple[list[str], dict[str, str]]:
        argv = [sys.executable, str(holder), str(gib), "1" if nccl_rank is not None else "0"]
        if args.simulated:
            argv += ["--sim-gpu", str(i)]
        e = {"CUDA_VISIBLE_DEVICES": uuids[i], "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        if ours:
            e[OWNER_ENV] = marker
        if nccl_rank is not None:
            e.update(BENCH_RANK=str(nccl_rank), BENCH_WORLD="2", BENCH_PORT=port)
        return argv + title, e

    jobs = [
        job(
            i,
            args.gib,
            [f"sglang::scheduler_TP{i}"],
            True,
            i if i < 2 and not args.simulated else None,
        )
        for i in range(n)
    ]
    jobs.append(job(n - 1, args.gib / 2, ["launch_server", "--tp-size", str(n)], False))
    jobs.append(job(1, 0.25, ["trainer", "--epochs", "1"], False))
    started = time.monotonic()
    procs = launch(jobs, env, timeout=300)
    out["holders_ready_s"] = round(time.monotonic() - started, 2)
    idents = {i: procs[i][0] for i in procs}
    foreign = idents[n + 1]
    out["nccl_all_reduce"] = {str(i): procs[i][1] for i in (0, 1)}  # expect "3" each on GPUs
    try:
        recorded = tuple(idents[i] for i in range(0, n, 2))
        RecordStore(str(state)).save(LaunchRecord(2**22 + 1, "primary", recorded))
        before = {s.index: round(s.memory_used_bytes / MiB) for s in nvml.snapshot()}
        sampler = Sampler(nvml)
        sampler.start()
        t0 = time.monotonic()
        owner = ProcessOwner(marker, lambda _l, _s, _x: None, lambda _c: None)
        sweep = await gpu.sweep_leftovers(
            owner.sweep, nvml, set(recorded), set(owner.marked_processes())
        )
        devices = tuple(uuids[i] for i in sorted(uuids, reverse=True))
        cfg = GpusConfig(True, devices, "kill-matching", ("sglang", "launch_server"), 60.0, 2048)
        clean = await gpu.clean(cfg, nvml, current=set(), recorded=set(), owner=marker)
        await asyncio.sleep(0.3)
        sampler.stop.set()
        sampler.join()
        metrics = Metrics()
        metrics.count_leftovers(sweep.killed_rows())
        metrics.count_leftovers(clean.killed_rows())
        per_gpu = []
        for i in range(n):
            final = sampler.samples[-1][1][i][0]
            back = next(
                (ts for ts, g in sampler.samples if ts >= t0 and g[i][0] <= final + 64 * MiB),
                None,
            )
            counted = metrics.registry.get_sample_value(
                "kimi_serve_gpu_leftover_processes_killed_total", {"gpu": str(i), "UUID": uuids[i]}
            )
            per_gpu.append(
                {
                    "gpu": i,
                    "uuid": uuids[i],
                    "used_mib_before": before[i],
                    "used_mib_after": round(final / MiB),
                    "memory_back_s": None if back is None else round(back - t0, 3),
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
        ((outside_ident, _r),) = launch(
            [job(n - 1, 0.25, ["launch_server", "--port", "30001"], False)], env, timeout=120
        ).values()
        idents[-1] = outside_ident
        cfg0 = GpusConfig(True, (0,), "kill-matching", ("sglang", "launch_server"), 10.0, 2048)
        only0 = await gpu.clean(cfg0, nvml, current=set(), recorded=set(), owner=marker)
        out["outside"] = {
            "gpu": n - 1,
            "clean_ok": only0.ok,
            "found": [c.pid for c in only0.found],
            "alive": live_process(outside_ident) is not None,
        }
    finally:
        for ident in idents.values():
            signal_identity(ident, signal.SIGKILL)
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
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "gpu_multi.json").write_text(json.dumps(out, indent=1, default=str))
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
    return verdict(checks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="GiB each scheduler allocates")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--simulated", action="store_true", help="no GPU: 4 simulated GPUs")
    return run(main_async, ap.parse_args())


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
