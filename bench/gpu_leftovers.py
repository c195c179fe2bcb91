#!/usr/bin/env python3
"""GPU leftovers on real hardware: found, classified, removed; a foreign process untouched.

What it does, on one GPU:
1. Starts GPU processes that each allocate memory with torch, with command lines like SGLang's
   (`sglang::scheduler_TP0` as last argument, `launch_server`), through a launcher that exits at
   once: they are orphans in sessions of their own, as a scheduler still loading is when its
   parent dies (sglang #23627). One of them ignores SIGTERM, so SIGKILL is needed.
2. Also starts: a process whose command line matches nothing but which a launch record (the
   daemon's state dir) names, one more such recorded process holding no GPU memory, and one
   foreign GPU process that matches nothing. The record also names the foreign process's pid
   with another start time, as a reused pid would look.
3. Runs `kimi-serve gpu-clean --dry-run` (nothing may die), then `kimi-serve gpu-clean`, while a
   thread samples NVML every 10 ms on its own: when each process died, when NVML stopped listing
   it, when the memory came back.
4. Then a foreign process holding memory over the threshold: gpu-clean must fail (exit 1) and
   name the GPU, the memory and the pid.

Prints a table and writes gpu_leftovers.json to --out (default $OUT, else the current dir).

    python3 bench/gpu_leftovers.py                 # on a machine with an NVIDIA GPU and torch
    python3 bench/gpu_leftovers.py --simulated     # anywhere: the simulated NVML, no torch

Everything it starts is killed (identity-checked) before it exits, whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from supervisor.process.identity import (  # noqa: E402
    LaunchRecord,
    ProcessIdentity,
    RecordStore,
    identity_of,
    live_process,
    signal_identity,
)

MiB = 1 << 20
GiB = 1 << 30

# argv: GIB MODE TITLE...; reports its pid on BENCH_READY_FD once the memory is really taken.
HOLDER = r"""
import os, signal, sys
gib, mode = float(sys.argv[1]), sys.argv[2]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if gib > 0 and not os.environ.get("KIMI_SERVE_SIMULATED_GPUS"):
    import torch
    x = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
fd = int(os.environ["BENCH_READY_FD"])
os.write(fd, b"%d\n" % os.getpid())
os.close(fd)
while True:
    signal.pause()
"""
# Starts every argv in a session of its own and exits: the holders become orphans.
LAUNCHER = r"""
import json, os, subprocess, sys
fd = int(os.environ["BENCH_READY_FD"])
for argv in json.loads(sys.argv[1]):
    subprocess.Popen(argv, start_new_session=True, pass_fds=(fd,), stdin=subprocess.DEVNULL)
"""


@dataclass
class Spec:
    name: str
    gib: float
    title: list[str]
    expect: str  # the kind gpu-clean should report ("" when it should not list it)
    should_die: bool
    ignore_term: bool = False
    record: bool = False
    ident: ProcessIdentity | None = None
    ppid_after_launch: int | None = None


@dataclass
class Sample:
    t: float
    used: int
    pids: frozenset[int]
    alive: frozenset[int]


class Gpu:
    """NVML's view of one GPU: the real one, or the simulation (--simulated)."""

    def __init__(self, index: int, simulated: bool) -> None:
        self.simulated = simulated
        if simulated:
            from supervisor.gpu.sim import SimulatedNvml

            self.sim = SimulatedNvml.from_env(os.environ)
            self.uuid = self.sim.snapshot()[index].uuid
            self.name, self.driver = "simulated", "-"
        else:
            import pynvml

            self.nv = pynvml
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.uuid = str(pynvml.nvmlDeviceGetUUID(self.handle))
            self.name = str(pynvml.nvmlDeviceGetName(self.handle))
            self.driver = str(pynvml.nvmlSystemGetDriverVersion())
        self.index = index

    def read(self) -> tuple[int, dict[int, int | None]]:
        if self.simulated:
            snap = self.sim.snapshot()[self.index]
            return snap.memory_used_bytes, {p.pid: p.used_bytes for p in snap.processes}
        nv = self.nv
        used = int(nv.nvmlDeviceGetMemoryInfo(self.handle, version=nv.nvmlMemory_v2).used)
        procs = nv.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return used, {int(p.pid): p.usedGpuMemory for p in procs}


class Sampler(threading.Thread):
    def __init__(self, gpu: Gpu, watch: Sequence[ProcessIdentity], interval: float) -> None:
        super().__init__(daemon=True)
        self.gpu, self.watch, self.interval = gpu, list(watch), interval
        self.samples: list[Sample] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            used, procs = self.gpu.read()
            alive = frozenset(i.pid for i in self.watch if live_process(i) is not None)
            self.samples.append(Sample(time.monotonic(), used, frozenset(procs), alive))
            self.stop.wait(self.interval)


def launch(specs: list[Spec], holder: Path, env: dict[str, str], timeout: float) -> None:
    """Start the holders through a launcher that exits; fill in each spec's identity."""
    r, w = os.pipe()
    argvs = []
    for s in specs:
        argv = [sys.executable, str(holder), str(s.gib), "ignore-term" if s.ignore_term else "-"]
        if env.get("KIMI_SERVE_SIMULATED_GPUS") and s.gib > 0:
            argv += ["--sim-gpu", "0"]
        argvs.append(argv + s.title)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, json.dumps(argvs)],
        env={**env, "BENCH_READY_FD": str(w)},
        pass_fds=(w,),
    )
    os.close(w)
    launcher.wait()
    pids: list[int] = []
    buf = b""
    deadline = time.monotonic() + timeout
    with os.fdopen(r, "rb", buffering=0) as pipe:
        while len(pids) < len(specs):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                raise RuntimeError(f"only {len(pids)} of {len(specs)} holders became ready")
            chunk = pipe.read(4096)
            if not chunk:
                raise RuntimeError(f"holders exited early: {len(pids)} of {len(specs)} ready")
            buf += chunk
            *lines, buf = buf.split(b"\n")
            pids += [int(x) for x in lines if x]
    for pid in pids:
        proc = psutil.Process(pid)
        spec = next(s for s, a in zip(specs, argvs, strict=True) if proc.cmdline() == a)
        spec.ident = identity_of(pid)
        spec.ppid_after_launch = proc.ppid()


def gpu_clean(config: Path, env: dict[str, str], dry_run: bool) -> dict[str, Any]:
    """`kimi-serve gpu-clean`, as the console script runs it (supervisor.cli's main)."""
    argv = [sys.executable, "-m", "supervisor.cli", "gpu-clean", "--config", str(config)]
    started = time.monotonic()
    p = subprocess.run(
        argv + (["--dry-run"] if dry_run else []),
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return {
        "command": "kimi-serve gpu-clean" + (" --dry-run" if dry_run else ""),
        "rc": p.returncode,
        "wall_s": round(time.monotonic() - started, 3),
        "started": started,
        "stdout": p.stdout,
        "stderr": p.stderr,
    }


def parse_rows(stdout: str) -> dict[int, dict[str, str]]:
    """gpu-clean's process table: PID, GPU, MEMORY, KIND, ACTION, USER, COMMAND [WHY]."""
    rows: dict[int, dict[str, str]] = {}
    section = False
    for line in stdout.splitlines():
        if line.startswith("Processes:"):
            section = True
            continue
        if section and not line.startswith("  "):
            section = False
        if section and re.match(r"^  \d", line):
            cells = re.split(r"\s{2,}", line.strip(), maxsplit=6)
            rows[int(cells[0])] = {
                "gpu": cells[1],
                "memory": cells[2],
                "kind": cells[3],
                "action": cells[4],
            }
    return rows


def write_config(path: Path, state_dir: Path, gpu: Gpu, timeout: str, threshold_mib: int) -> None:
    path.write_text(
        "sglang: {model_path: /nonexistent/model}\n"
        f"state_dir: {state_dir}\n"
        "gpus:\n"
        f"  devices: [{gpu.uuid}]\n"
        "  leftover_policy: kill-matching\n"
        '  match: ["sglang", "launch_server"]\n'
        f"  memory_free_timeout: {timeout}\n"
        f"  memory_free_threshold_mib: {threshold_mib}\n"
    )


def first(samples: list[Sample], after: float, cond: Any) -> float | None:
    return next((s.t for s in samples if s.t >= after and cond(s)), None)


@dataclass
class Run:
    specs: list[Spec] = field(default_factory=list)

    def idents(self) -> list[ProcessIdentity]:
        return [s.ident for s in self.specs if s.ident is not None]

    def kill_all(self) -> None:
        for ident in self.idents():
            signal_identity(ident, signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU to use")
    ap.add_argument("--gib", type=float, default=4.0, help="GiB each leftover allocates")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--simulated", action="store_true", help="no GPU: the simulated NVML")
    args = ap.parse_args()

    env = dict(os.environ)
    if args.simulated:
        env.update(
            KIMI_SERVE_SIMULATED_GPUS=str(args.gpu + 1),
            KIMI_SERVE_SIM_TAG=f"bench-{uuid.uuid4().hex[:8]}",
            # One size for every simulated process: under the threshold, as the real foreign
            # process is (the simulation has no per-process sizes).
            KIMI_SERVE_SIMULATED_GPU_MIB="1024",
        )
        os.environ.update(env)
    gpu = Gpu(args.gpu, args.simulated)
    # Pin every holder to this GPU whatever CUDA's own device order is.
    env.update(CUDA_VISIBLE_DEVICES=gpu.uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    work = Path(tempfile.mkdtemp(prefix="kimi-gpu-bench-"))
    holder = work / "holder.py"
    holder.write_text(HOLDER)
    state = work / "state"
    state.mkdir()
    cfg = work / "kimi-serve.yaml"
    # The foreign process keeps ~1 GiB (its CUDA context and 0.25 GiB) on the GPU: "free"
    # here means under 2 GiB, so that it does not block.
    threshold_mib = 2048
    write_config(cfg, state, gpu, "60s", threshold_mib)
    used0, procs0 = gpu.read()
    result: dict[str, Any] = {
        "machine": {
            "gpu": gpu.name,
            "uuid": gpu.uuid,
            "driver": gpu.driver,
            "host_cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "simulated": args.simulated,
        },
        "gpu_before": {"used_mib": used0 / MiB, "processes": sorted(procs0)},
        "threshold_mib": threshold_mib,
    }
    run = Run(
        [
            Spec("scheduler_TP0", args.gib, ["sglang::scheduler_TP0"], "leftover", True),
            Spec(
                "scheduler_TP1 (ignores SIGTERM)",
                args.gib,
                ["sglang::scheduler_TP1"],
                "leftover",
                True,
                ignore_term=True,
            ),
            Spec("launch_server", args.gib, ["launch_server", "--tp-size", "1"], "leftover", True),
            Spec("recorded worker", args.gib / 2, ["model_worker"], "leftover", True, record=True),
            Spec("recorded, no GPU", 0, ["sglang::detokenizer"], "leftover", True, record=True),
            Spec("foreign", 0.25, ["trainer", "--epochs", "1"], "foreign", False),
        ]
    )
    blocker = Run()
    try:
        t = time.monotonic()
        launch(run.specs, holder, env, timeout=180)
        result["launch_s"] = round(time.monotonic() - t, 2)
        foreign = run.specs[-1].ident
        assert foreign is not None
        # The record of a daemon that died: two of ours, and the foreign pid with another start
        # time (a pid reused since it was recorded), which must not make it ours.
        decoy = ProcessIdentity(foreign.pid, foreign.create_time - 1000.0)
        recorded = (*(s.ident for s in run.specs if s.record and s.ident), decoy)
        dead_daemon = 2**22 + 1  # above the default pid_max: no such process
        RecordStore(str(state)).save(LaunchRecord(dead_daemon, "primary", recorded))
        used1, procs1 = gpu.read()
        result["gpu_with_leftovers"] = {
            "used_mib": round(used1 / MiB),
            "processes": {str(p): None if b is None else round(b / MiB) for p, b in procs1.items()},
        }

        dry = gpu_clean(cfg, env, dry_run=True)
        dry["all_alive_after"] = all(live_process(i) for i in run.idents())
        result["dry_run"] = dry

        sampler = Sampler(gpu, run.idents(), interval=0.01)
        sampler.start()
        clean = gpu_clean(cfg, env, dry_run=False)
        time.sleep(0.5)  # a little tail of samples after gpu-clean returned
        sampler.stop.set()
        sampler.join()
        rows = parse_rows(clean["stdout"])
        t0 = clean["started"]
        samples = sampler.samples
        final_used = samples[-1].used
        released = first(samples, t0, lambda s: s.used <= final_used + 64 * MiB)
        procs_out = []
        for s in run.specs:
            assert s.ident is not None
            pid = s.ident.pid
            died = first(samples, t0, lambda x, pid=pid: pid not in x.alive)
            unlisted = first(samples, t0, lambda x, pid=pid: pid not in x.pids)
            row = rows.get(pid, {})
            procs_out.append(
                {
                    "name": s.name,
                    "pid": pid,
                    "cmdline_tail": " ".join(s.title),
                    "gib": s.gib,
                    "recorded": s.record,
                    "parent_after_launch": s.ppid_after_launch,
                    "expected": s.expect,
                    "classified": row.get("kind", ""),
                    "action": row.get("action", ""),
                    "alive_after": live_process(s.ident) is not None,
                    "died_at_s": None if died is None else round(died - t0, 3),
                    "unlisted_by_nvml_at_s": None if unlisted is None else round(unlisted - t0, 3),
                }
            )
        last_death = max((p["died_at_s"] or 0.0) for p in procs_out if p["expected"] == "leftover")
        m = re.search(r"memory free after ([\d.]+)s", clean["stdout"])
        result["clean"] = clean | {
            "reported_release_s": float(m.group(1)) if m else None,
            "samples": len(samples),
            "used_mib_before": round(samples[0].used / MiB),
            "used_mib_after": round(final_used / MiB),
            "memory_back_at_s": None if released is None else round(released - t0, 3),
            "memory_back_after_last_death_s": None
            if released is None
            else round(released - t0 - last_death, 3) + 0.0,
            "timeline_mib": [
                [round(s.t - t0, 3), round(s.used / MiB), len(s.pids)] for s in samples[::5]
            ],
        }
        result["processes"] = procs_out
        result["foreign_survived"] = live_process(foreign) is not None

        run.kill_all()

        # A foreign process holding memory over the threshold: the launch must not go ahead.
        blocker.specs.append(Spec("foreign, 4 GiB", 4.0, ["trainer-big"], "foreign", False))
        launch(blocker.specs, holder, env, timeout=180)
        cfg2 = work / "kimi-serve-blocked.yaml"
        # (Simulated processes all hold 1 GiB: there the threshold goes under it instead.)
        write_config(cfg2, state, gpu, "3s", 512 if args.simulated else threshold_mib)
        blocked = gpu_clean(cfg2, env, dry_run=False)
        big = blocker.specs[0].ident
        assert big is not None
        blocked["foreign_pid"] = big.pid
        blocked["foreign_survived"] = live_process(big) is not None
        blocked["last_line"] = blocked["stdout"].strip().splitlines()[-1]
        result["blocked"] = blocked
    finally:
        run.kill_all()
        blocker.kill_all()
        everyone = run.idents() + blocker.idents()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            _, procs = gpu.read()
            if not any(live_process(i) for i in everyone) and not set(procs) & {
                i.pid for i in everyone
            }:
                break
            time.sleep(0.05)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_leftovers.json").write_text(json.dumps(result, indent=1))
    report(result)
    ok = (
        result["dry_run"]["all_alive_after"]
        and result["clean"]["rc"] == 0
        and result["foreign_survived"]
        and all(p["alive_after"] != (p["expected"] == "leftover") for p in result["processes"])
        and result["blocked"]["rc"] == 1
        and result["blocked"]["foreign_survived"]
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def report(r: dict[str, Any]) -> None:
    m = r["machine"]
    print(f"\n{m['gpu']} {m['uuid']} driver {m['driver']}; holders ready in {r['launch_s']}s")
    print(f"GPU with leftovers: {r['gpu_with_leftovers']['used_mib']} MiB used")
    print(f"dry run: exit {r['dry_run']['rc']}, all still alive: {r['dry_run']['all_alive_after']}")
    print(
        f"\n{'process':<32} {'pid':>7} {'GiB':>5}  {'expected':<9} {'classified':<10} "
        f"{'action':<28} {'alive':<5} {'died s':>7} {'unlisted s':>10}"
    )
    for p in r["processes"]:
        print(
            f"{p['name']:<32} {p['pid']:>7} {p['gib']:>5} {p['expected']:<9} "
            f"{p['classified'] or '-':<10} {p['action'] or '-':<28} {p['alive_after']!s:<5} "
            f"{p['died_at_s'] if p['died_at_s'] is not None else '-':>7} "
            f"{p['unlisted_by_nvml_at_s'] if p['unlisted_by_nvml_at_s'] is not None else '-':>10}"
        )
    c = r["clean"]
    print(
        f"\ngpu-clean: exit {c['rc']} in {c['wall_s']}s; {c['used_mib_before']} -> "
        f"{c['used_mib_after']} MiB; memory back at {c['memory_back_at_s']}s "
        f"({c['memory_back_after_last_death_s']}s after the last death); gpu-clean reported "
        f"{c['reported_release_s']}s; foreign survived: {r['foreign_survived']}"
    )
    print(c["stdout"].strip().splitlines()[-1])
    b = r["blocked"]
    print(f"\nblocked by a foreign 4 GiB process: exit {b['rc']} in {b['wall_s']}s")
    print(b["last_line"])


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
