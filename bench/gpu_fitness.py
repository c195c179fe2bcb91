"""GPU fitness and leftover counting on real hardware (one GPU is enough).

1. Fitness read on real NVML: every field as the driver reports it (`PynvmlNvml.health()`),
   the verdict and its line, and a few calls this driver answers "not supported", read through
   the same path so that answer is seen as NOT_SUPPORTED, never as a zero.
2. The critical-event set: which event types register, and how long `wait()` takes to return
   with nothing happening (it must return on time, in its slice); then the Xid watcher task
   (`fitness_watch.Monitor.watch`) run on the loop and cancelled: how long until it stopped
   and the set was freed.
3. A daemon crash with an orphan holding GPU memory: a launch record and owner marker as a
   SIGKILLed daemon leaves them, naming a torch process whose command line ends in
   `sglang::scheduler_TP0` (an orphan in its own session); an orphan found only by its marker
   (`sglang::detokenizer`, no GPU memory); an orphan found only by NVML and `gpus.match`
   (`launch_server`, not recorded, no marker); and a foreign torch process. The restarted
   daemon's path: `gpu.sweep_leftovers()` (the launch-record sweep, reading NVML before the
   kill), then `gpu.clean()`; both counted into
   `kimi_serve_gpu_leftover_processes_killed_total` on a fresh registry. The foreign process
   must survive.

    python -m bench gpu-fitness --out $OUT        # on a machine with an NVIDIA GPU and torch
    python -m bench gpu-fitness --simulated       # anywhere: the simulated NVML, no torch
    python -m bench gpu-fitness --simulated --quick   # the suite's form (tests/bench)

Writes gpu_fitness.json to --out and prints a summary; exit 0 when every check held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from typing import Any

from bench import common
from supervisor import gpu
from supervisor.config import GpusConfig
from supervisor.gpu import fitness, fitness_watch
from supervisor.gpu.nvml import gpu_status
from supervisor.gpu.sim import open_nvml
from supervisor.metrics import Metrics
from supervisor.process import ProcessOwner
from supervisor.process.identity import OWNER_ENV, LaunchRecord, RecordStore, live_process
from supervisor.threads import in_thread

NVLINK_CRC_FIELD = 100  # NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: not supported on a lone GPU


def raw_calls(index: int) -> dict[str, Any]:
    """What the driver answers to each call, verbatim (return code or value)."""
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    out: dict[str, Any] = {}

    def call(name: str, fn: Any) -> None:
        t = time.perf_counter()
        try:
            v = fn()
            out[name] = {"value": v, "ms": round((time.perf_counter() - t) * 1000, 3)}
        except pynvml.NVMLError as exc:
            out[name] = {"error": str(exc), "code": exc.value}

    def field(fid: int) -> dict[str, Any]:
        v = pynvml.nvmlDeviceGetFieldValues(h, [fid])[0]
        return {
            "nvmlReturn": int(v.nvmlReturn),
            "valueType": int(v.valueType),
            "ullVal": int(v.value.ullVal),
        }

    call("field GET_GPU_RECOVERY_ACTION", lambda: field(230))
    call("field NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", lambda: field(NVLINK_CRC_FIELD))
    call("nvmlDeviceGetRemappedRows", lambda: list(pynvml.nvmlDeviceGetRemappedRows(h)))
    call("nvmlDeviceGetEccMode", lambda: list(pynvml.nvmlDeviceGetEccMode(h)))
    call(
        "ecc uncorrected volatile",
        lambda: pynvml.nvmlDeviceGetTotalEccErrors(
            h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
        ),
    )
    call(
        "nvmlDeviceGetRetiredPagesPendingStatus",
        lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h),
    )
    call("nvmlDeviceGetSupportedEventTypes", lambda: pynvml.nvmlDeviceGetSupportedEventTypes(h))
    return out


def not_supported_path(index: int) -> dict[str, Any]:
    """A field the driver does not support, through the same reading code as the real fields:
    it must come out as NOT_SUPPORTED."""
    import pynvml

    from supervisor.gpu.nvml import _NOT_SUPPORTED, _field_value

    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    v = pynvml.nvmlDeviceGetFieldValues(h, [NVLINK_CRC_FIELD])[0]
    ret = int(v.nvmlReturn)
    value: Any = fitness.NOT_SUPPORTED.value if ret == _NOT_SUPPORTED else _field_value(v)
    try:
        pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h)
        retired: Any = "supported"
    except pynvml.NVMLError as exc:
        retired = fitness.NOT_SUPPORTED.value if exc.value == _NOT_SUPPORTED else str(exc)
    return {
        "nvlink_crc_field": {"nvmlReturn": ret, "reads_as": value},
        "retired_pages_pending": retired,
    }


async def events_phase(source: Any, quick: bool) -> dict[str, Any]:
    events = await in_thread(source.open_events, 10.0)
    out: dict[str, Any] = {
        "registered": {str(k): v for k, v in getattr(events, "registered", {}).items()},
        "unsupported": {str(k): v for k, v in getattr(events, "unsupported", {}).items()},
        "waits": [],
    }
    for ms in (200,) if quick else (500, 1000, 2000):
        t = time.monotonic()
        got = await in_thread(lambda ms=ms: events.wait(ms), ms / 1000 + 10)
        out["waits"].append(
            {
                "timeout_ms": ms,
                "returned_s": round(time.monotonic() - t, 4),
                "events": [e.to_dict() for e in got],
            }
        )
    events.close()
    # The watcher task on the loop, then cancelled: the loop must stay responsive meanwhile.
    posted: list[Any] = []
    mon = fitness_watch.Monitor(source, "all", posted.append)
    events2 = await in_thread(source.open_events, 10.0)
    task = asyncio.get_running_loop().create_task(mon.watch(events2, slice_s=1.0))
    lags = []
    ran = 1.2 if quick else 3.0  # more than one slice of the watcher
    t_end = time.monotonic() + ran
    while time.monotonic() < t_end:
        t = time.monotonic()
        await asyncio.sleep(0.05)
        lags.append(time.monotonic() - t - 0.05)
    t = time.monotonic()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    out["watch"] = {
        "ran_s": ran,
        "loop_max_lag_ms": round(max(lags) * 1000, 2),
        "cancel_to_closed_s": round(time.monotonic() - t, 4),
        "faults_posted": [repr(p) for p in posted],
    }
    return out


async def crash_phase(gpu_: common.Gpu, env: dict[str, str], gib: float) -> dict[str, Any]:
    holder, state, marker, _work = common.scene("kimi-fitness-bench-")
    ours = {OWNER_ENV: marker}
    names = [
        "scheduler (recorded)",
        "detokenizer (owner marker)",
        "launch_server (NVML + match)",
        "trainer (foreign)",
    ]
    jobs = [
        (common.holder_argv(holder, gib, ["sglang::scheduler_TP0"], sim_gpu=0), ours),
        (common.holder_argv(holder, 0, ["sglang::detokenizer"]), ours),
        (common.holder_argv(holder, gib / 2, ["launch_server", "--tp-size", "1"], sim_gpu=0), {}),
        (common.holder_argv(holder, 0.25, ["trainer", "--epochs", "1"], sim_gpu=0), {}),
    ]
    result: dict[str, Any] = {}
    held: list[common.Held] = []
    try:
        held = common.launch_orphans(jobs, env, timeout=180)
        # What a SIGKILLed daemon leaves: its record naming the scheduler, and processes with
        # its marker. The daemon pid is dead.
        RecordStore(str(state)).save(LaunchRecord(2**22 + 1, "primary", (held[0].ident,)))
        result["gpu_with_orphans"] = gpu_.usage() | {
            "parents": {n: h.ppid for n, h in zip(names, held, strict=True)}
        }
        nvml = open_nvml()
        metrics = Metrics()
        owner = ProcessOwner(marker, lambda _l, _s, _lines: None, lambda _c: None)
        record = RecordStore(str(state)).load()
        rec = set(record.processes) if record else set()
        t0 = time.monotonic()
        # As the daemon's cleaning (host.clean): the record, its session, the owner marker.
        sweep = await gpu.sweep_leftovers(
            owner.sweep, nvml, rec, owner.evident(rec), match=("sglang",), owner=marker
        )
        t_sweep = time.monotonic() - t0
        metrics.count_leftovers(sweep.killed_rows())
        cfg = GpusConfig(
            manage=True,
            devices=(gpu_.uuid,),
            leftover_policy="kill-matching",
            match=("sglang", "launch_server"),
            memory_free_timeout=30.0,
            # The foreign process keeps its CUDA context (~0.9 GiB) and 0.25 GiB.
            memory_free_threshold_mib=2048,
        )
        t1 = time.monotonic()
        report = await gpu.clean(cfg, nvml, current=set(), recorded=set(), owner=marker)
        t_clean = time.monotonic() - t1
        metrics.count_leftovers(report.killed_rows())
        health = await fitness_watch.Monitor(nvml, (gpu_.uuid,), lambda _e: None).before_launch()
        nvml.close()
        text = metrics.render().decode()
        series = [
            line
            for line in text.splitlines()
            if line.startswith("kimi_serve_gpu_leftover_processes_killed_total")
        ]
        result.update(
            sweep=sweep.to_dict(),
            sweep_s=round(t_sweep, 3),
            clean=report.to_dict() | {"before": None, "after": None},
            clean_s=round(t_clean, 3),
            clean_message=report.message,
            status_leftovers=gpu.leftover_status(sweep, report),
            metric_series=series,
            fit_after=health is None,
            alive_after={
                n: live_process(h.ident) is not None for n, h in zip(names, held, strict=True)
            },
        )
        used2, procs2 = gpu_.read()
        result["gpu_after"] = {"used_mib": round(used2 / common.MiB), "processes": sorted(procs2)}
    finally:
        common.kill_held(held)
    return result


async def main_async(args: Any) -> int:
    env = common.simulate_gpus(1) if args.simulated else dict(os.environ)
    g = common.Gpu(args.gpu, args.simulated)
    env = g.pin(env)
    out: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": g.machine(),
    }
    source = open_nvml()
    t = time.perf_counter()
    reads = await fitness_watch.read(source, "all")
    out["health_read_ms"] = round((time.perf_counter() - t) * 1000, 2)
    report = fitness.assess_all(reads)
    out["health"] = [f.health() for f in report.gpus]
    out["verdict_line"] = report.line()
    # /status.gpus[] as the daemon serves it: the snapshot carries the health read.
    out["status_gpus"] = gpu_status(await in_thread(source.snapshot, 10.0))
    if not args.simulated:
        out["raw_calls"] = raw_calls(args.gpu)
        out["not_supported_path"] = not_supported_path(args.gpu)
    out["events"] = await events_phase(source, args.quick)
    source.close()
    out["crash"] = await crash_phase(g, env, args.gib)

    c = out["crash"]
    waits_ok = all(
        w["timeout_ms"] / 1000 - 0.05 <= w["returned_s"] <= w["timeout_ms"] / 1000 + 0.5
        for w in out["events"]["waits"]
    )
    checks = {
        "health read, verdict ok": report.ok,
        "event waits returned on time": waits_ok,
        "watcher cancelled within a slice": out["events"]["watch"]["cancel_to_closed_s"] < 1.5,
        "loop never blocked by the watcher": out["events"]["watch"]["loop_max_lag_ms"] < 100,
        "sweep killed the recorded and the marked orphan": sum(
            1 for p in c["sweep"]["processes"] if p["action"].endswith("exited")
        )
        == 2,
        "recorded orphan's GPU memory seen before the kill": any(
            p["found_by"] == "launch record" and (p["used_bytes"] or 0) > 0
            for p in c["sweep"]["processes"]
        ),
        "clean killed the NVML-matched orphan": sum(c["clean"]["killed"].values()) == 1,
        "counter counts all three": sum(float(s.rsplit(" ", 1)[1]) for s in c["metric_series"])
        == 3,
        "foreign survived": c["alive_after"]["trainer (foreign)"],
        "orphans gone": not any(v for k, v in c["alive_after"].items() if "foreign" not in k),
        "clean ok": c["clean"]["ok"],
    }
    out["checks"] = checks
    common.write_json(args.out, "gpu_fitness.json", out)
    shown = ("gpu_with_orphans", "sweep", "sweep_s", "clean_s", "clean_message")
    shown += ("metric_series", "alive_after", "gpu_after", "fit_after")
    for part in (
        {k: out[k] for k in ("machine", "health_read_ms", "health", "verdict_line")},
        out.get("raw_calls"),
        out.get("not_supported_path"),
        out["events"],
        {k: c[k] for k in shown},
    ):
        print(json.dumps(part, indent=1, default=str))
    return common.verdict(checks)


def main(argv: list[str] | None = None) -> int:
    ap = common.gpu_args("gpu-fitness", __doc__ or "", "GiB the recorded orphan allocates")
    ap.add_argument("--quick", action="store_true", help="one short event wait (the suite's form)")
    return common.run_gpu_bench(main_async, ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
