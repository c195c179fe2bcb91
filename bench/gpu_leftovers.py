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

    python -m bench gpu-leftovers                  # a machine with an NVIDIA GPU and torch
    python -m bench gpu-leftovers --simulated      # anywhere: the simulated NVML, no torch
    python -m bench gpu-leftovers --simulated --quick   # the suite's form (tests/bench)

Everything it starts is killed (identity-checked) before it exits, whatever happens.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import common
from supervisor.process.identity import LaunchRecord, ProcessIdentity, RecordStore, live_process


@dataclass
class Spec:
    name: str
    gib: float
    title: list[str]
    expect: str  # the kind gpu-clean should report: "leftover" or "foreign"
    ignore_term: bool = False
    record: bool = False


def gpu_clean(config: Path, env: dict[str, str], dry_run: bool) -> dict[str, Any]:
    """`kimi-serve gpu-clean`, as the console script runs it (supervisor.cli's main)."""
    argv = [str(common.PYTHON), "-m", "supervisor.cli", "gpu-clean", "--config", str(config)]
    started = time.monotonic()
    p = subprocess.run(
        argv + (["--dry-run"] if dry_run else []),
        env={**env, "PYTHONPATH": common.repo_path(env)},
        cwd=common.REPO_ROOT,
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
            rows[int(cells[0])] = dict(
                zip(("gpu", "memory", "kind", "action"), cells[1:5], strict=False)
            )
    return rows


def write_config(
    path: Path, state_dir: Path, gpu: common.Gpu, timeout: str, threshold_mib: int
) -> None:
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


def start(specs: list[Spec], holder: Path, env: dict[str, str]) -> list[common.Held]:
    jobs = [
        (common.holder_argv(holder, s.gib, s.title, "ignore-term" if s.ignore_term else "-", 0), {})
        for s in specs
    ]
    return common.launch_orphans(jobs, env, timeout=180)


def specs_for(gib: float) -> list[Spec]:
    return [
        Spec("scheduler_TP0", gib, ["sglang::scheduler_TP0"], "leftover"),
        Spec("scheduler_TP1 (ignores SIGTERM)", gib, ["sglang::scheduler_TP1"], "leftover", True),
        Spec("launch_server", gib, ["launch_server", "--tp-size", "1"], "leftover"),
        Spec("recorded worker", gib / 2, ["model_worker"], "leftover", record=True),
        Spec("recorded, no GPU", 0, ["sglang::detokenizer"], "leftover", record=True),
        Spec("foreign", 0.25, ["trainer", "--epochs", "1"], "foreign"),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = common.gpu_args("gpu-leftovers", __doc__ or "", "GiB each leftover allocates")
    ap.add_argument(
        "--quick", action="store_true", help="no SIGTERM-ignoring holder, 1 s to be blocked"
    )
    args = ap.parse_args(argv)
    # Simulated: one size for every process (1 GiB), under the threshold as the real foreign
    # process is (the simulation has no per-process sizes).
    env = common.simulate_gpus(args.gpu + 1) if args.simulated else dict(os.environ)
    gpu = common.Gpu(args.gpu, args.simulated)
    env = gpu.pin(env)
    holder, state, _marker, work = common.scene("kimi-gpu-bench-")
    specs = [s for s in specs_for(args.gib) if not (args.quick and s.ignore_term)]
    cfg = work / "kimi-serve.yaml"
    # The foreign process keeps ~1 GiB (its CUDA context and 0.25 GiB) on the GPU: "free"
    # here means under 2 GiB, so that it does not block.
    threshold_mib = 2048
    write_config(cfg, state, gpu, "60s", threshold_mib)
    used0, procs0 = gpu.read()
    result: dict[str, Any] = {
        "machine": gpu.machine(),
        "gpu_before": {"used_mib": used0 / common.MiB, "processes": sorted(procs0)},
        "threshold_mib": threshold_mib,
    }
    held: list[common.Held] = []
    blocker: list[common.Held] = []
    try:
        t = time.monotonic()
        held = start(specs, holder, env)
        result["launch_s"] = round(time.monotonic() - t, 2)
        foreign = held[-1].ident
        # The record of a daemon that died: two of ours, and the foreign pid with another start
        # time (a pid reused since it was recorded), which must not make it ours.
        decoy = ProcessIdentity(foreign.pid, foreign.create_time - 1000.0)
        recorded = (*(h.ident for s, h in zip(specs, held, strict=True) if s.record), decoy)
        dead_daemon = 2**22 + 1  # above the default pid_max: no such process
        RecordStore(str(state)).save(LaunchRecord(dead_daemon, "primary", recorded))
        result["gpu_with_leftovers"] = gpu.usage()
        dry = gpu_clean(cfg, env, dry_run=True)
        dry["all_alive_after"] = all(live_process(h.ident) for h in held)
        result["dry_run"] = dry

        def read() -> tuple[int, frozenset[int], frozenset[int]]:
            used, procs = gpu.read()
            alive = frozenset(h.ident.pid for h in held if live_process(h.ident) is not None)
            return used, frozenset(procs), alive

        sampler = common.Sampler(read)
        clean = gpu_clean(cfg, env, dry_run=False)
        time.sleep(0.5)  # a little tail of samples after gpu-clean returned
        sampler.stop()
        rows = parse_rows(clean["stdout"])
        t0 = clean["started"]
        samples = sampler.samples
        final_used = samples[-1][1][0]
        procs_out = []
        for s, h in zip(specs, held, strict=True):
            pid = h.ident.pid
            row = rows.get(pid, {})
            procs_out.append(
                {
                    "name": s.name,
                    "pid": pid,
                    "cmdline_tail": " ".join(s.title),
                    "gib": s.gib,
                    "recorded": s.record,
                    "parent_after_launch": h.ppid,
                    "expected": s.expect,
                    "classified": row.get("kind", ""),
                    "action": row.get("action", ""),
                    "alive_after": live_process(h.ident) is not None,
                    "died_at_s": sampler.first(t0, lambda v, pid=pid: pid not in v[2]),
                    "unlisted_by_nvml_at_s": sampler.first(t0, lambda v, pid=pid: pid not in v[1]),
                }
            )
        last_death = max((p["died_at_s"] or 0.0) for p in procs_out if p["expected"] == "leftover")
        released = sampler.first(t0, lambda v: v[0] <= final_used + 64 * common.MiB)
        m = re.search(r"memory free after ([\d.]+)s", clean["stdout"])
        result["clean"] = clean | {
            "reported_release_s": float(m.group(1)) if m else None,
            "samples": len(samples),
            "used_mib_before": round(samples[0][1][0] / common.MiB),
            "used_mib_after": round(final_used / common.MiB),
            "memory_back_at_s": released,
            "memory_back_after_last_death_s": None
            if released is None
            else round(released - last_death, 3) + 0.0,
            "timeline_mib": [
                [round(ts - t0, 3), round(v[0] / common.MiB), len(v[1])] for ts, v in samples[::5]
            ],
        }
        result["processes"] = procs_out
        result["foreign_survived"] = live_process(foreign) is not None
        common.kill_held(held)

        # A foreign process holding memory over the threshold: the launch must not go ahead.
        blocker = start([Spec("foreign, 4 GiB", 4.0, ["trainer-big"], "foreign")], holder, env)
        cfg2 = work / "kimi-serve-blocked.yaml"
        # (Simulated processes all hold 1 GiB: there the threshold goes under it instead.)
        write_config(
            cfg2, state, gpu, "1s" if args.quick else "3s", 512 if args.simulated else threshold_mib
        )
        blocked = gpu_clean(cfg2, env, dry_run=False)
        blocked["foreign_pid"] = blocker[0].ident.pid
        blocked["foreign_survived"] = live_process(blocker[0].ident) is not None
        said = (blocked["stdout"].strip() or blocked["stderr"].strip()).splitlines()
        blocked["last_line"] = said[-1] if said else f"(no output; exit {blocked['rc']})"
        result["blocked"] = blocked
    finally:
        everyone = held + blocker
        common.kill_held(everyone)
        pids = {h.ident.pid for h in everyone}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not any(live_process(h.ident) for h in everyone) and not set(gpu.read()[1]) & pids:
                break
            time.sleep(0.05)
    common.write_json(args.out, "gpu_leftovers.json", result)
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
        died, gone = p["died_at_s"], p["unlisted_by_nvml_at_s"]
        print(
            f"{p['name']:<32} {p['pid']:>7} {p['gib']:>5} {p['expected']:<9} "
            f"{p['classified'] or '-':<10} {p['action'] or '-':<28} {p['alive_after']!s:<5} "
            f"{'-' if died is None else died:>7} {'-' if gone is None else gone:>10}"
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
    sys.exit(main())
