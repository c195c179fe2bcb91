"""Several GPUs, simulated: every leftover counted per GPU whichever way it was found, devices
by index and by UUID, a foreign process on one GPU, memory waited for on every managed GPU, a
GPU outside gpus.devices never touched. (bench/gpu_multi.py runs the same on real GPUs.)"""

from __future__ import annotations

import uuid

import pytest

from supervisor.gpu import clean, leftover_status, sweep_leftovers
from supervisor.gpu.sim import SimulatedNvml, simulated_uuid
from supervisor.metrics import Metrics
from supervisor.process import ProcessOwner
from supervisor.process.identity import OWNER_ENV, ProcessIdentity, live_process
from testkit.gpu import Procs, gpus_cfg

GPUS = 4
# Unique per run: the marker scan looks at every process on the machine.
OWNER = f"/var/lib/kimi-serve-test-{uuid.uuid4().hex[:12]}"
MIB = 512


def alive(ident: ProcessIdentity) -> bool:
    return live_process(ident) is not None


def start_ours(procs: Procs, *args: str) -> ProcessIdentity:
    """A process carrying our owner marker, as every process of a launch does."""
    saved = procs.env
    procs.env = {**saved, OWNER_ENV: OWNER}
    try:
        return procs.start(*args, orphan=True)
    finally:
        procs.env = saved


def owner() -> ProcessOwner:
    return ProcessOwner(OWNER, lambda _l, _s, _x: None, lambda _c: None)


def killed(m: Metrics, gpu: str, uuid: str) -> float | None:
    return m.registry.get_sample_value(
        "kimi_serve_gpu_leftover_processes_killed_total", {"gpu": gpu, "UUID": uuid}
    )


@pytest.mark.parametrize("by", ["index", "uuid"])
async def test_a_crash_across_gpus_is_cleaned_and_every_leftover_counted_per_gpu(
    procs: Procs, by: str
) -> None:
    sim = SimulatedNvml(gpus=GPUS + 1, mib_per_process=MIB, tag=procs.tag)
    # What a SIGKILLed daemon leaves behind with tp 4 on GPUs 0-3: schedulers recorded in the
    # launch record (0, 1), one found by its marker only (2), a detokenizer recorded holding
    # no GPU memory, and one found only by NVML and gpus.match (3: no record, no marker).
    tp0 = start_ours(procs, "sglang::scheduler_TP0")
    tp1 = start_ours(procs, "sglang::scheduler_TP1")
    tp2 = start_ours(procs, "sglang::scheduler_TP2")
    detok = start_ours(procs, "sglang::detokenizer")
    tp3 = procs.start("launch_server", "--sim-gpu", "3", orphan=True)
    # Someone else's job on GPU 1, and a matching process on GPU 4, which is not ours.
    foreign = procs.start("python", "train.py", "--sim-gpu", "1", orphan=True)
    outside = procs.start("launch_server", "--sim-gpu", "4", orphan=True)
    devices: tuple[int | str, ...] = (
        (0, 1, 2, 3) if by == "index" else tuple(simulated_uuid(i) for i in (3, 1, 0, 2))
    )

    po = owner()
    sweep = await sweep_leftovers(po.sweep, sim, {tp0, tp1, detok}, set(po.marked_processes()))
    assert {(p.pid, p.found_by, p.killed) for p in sweep.processes} == {
        (tp0.pid, "launch record", True),
        (tp1.pid, "launch record", True),
        (tp2.pid, "owner marker", True),
        (detok.pid, "launch record", True),
    }
    held = {p.pid: p.held for p in sweep.processes}
    assert held[tp1.pid] == ((1, simulated_uuid(1), MIB << 20),)
    assert held[detok.pid] == ()
    assert "GPU 0: 512 MiB" in sweep.message() and "no GPU memory" in sweep.message()

    report = await clean(
        gpus_cfg(devices=devices, memory_free_threshold_mib=MIB),
        sim,
        current=set(),
        recorded=set(),
        owner=OWNER,
        term_grace=0.5,
        poll=0.02,
    )
    assert report.ok, report.message
    assert report.killed == {3: 1}
    assert [c.found_by for c in report.found if c.to_remove] == ["nvml"]
    assert {c.pid for c in report.foreign} == {foreign.pid}

    m = Metrics()
    m.count_leftovers(sweep.killed_rows())
    m.count_leftovers(report.killed_rows())
    for i in range(GPUS):
        assert killed(m, str(i), simulated_uuid(i)) == 1, i
    assert killed(m, "none", "none") == 1
    assert killed(m, "4", simulated_uuid(4)) is None

    status = leftover_status(sweep, report)
    assert status["killed"] == {"0": 1, "1": 1, "2": 1, "none": 1, "3": 1}
    assert {p["found_by"] for p in status["processes"]} == {
        "launch record",
        "owner marker",
        "nvml",
    }
    assert not any(alive(i) for i in (tp0, tp1, tp2, tp3, detok))
    assert alive(foreign) and alive(outside)


async def test_memory_is_waited_for_on_every_managed_gpu_not_the_first(procs: Procs) -> None:
    # GPU 0 is free; GPU 2 keeps memory with no process (a wedged GPU): not clean, and the
    # message names GPU 2.
    sim = SimulatedNvml(gpus=GPUS, mib_per_process=MIB, tag=procs.tag, wedged_mib={2: 4096})
    report = await clean(
        gpus_cfg(memory_free_timeout=0.3),
        sim,
        current=set(),
        recorded=set(),
        owner=OWNER,
        poll=0.02,
    )
    assert not report.ok
    assert report.message.startswith(f"GPU 2 ({simulated_uuid(2)[:12]}) still holds 4.0 GiB")


async def test_a_sweep_with_nothing_recorded_reads_nothing(procs: Procs) -> None:
    calls: list[object] = []

    async def sweep(idents: set[ProcessIdentity]) -> list[ProcessIdentity]:
        calls.append(idents)
        return []

    report = await sweep_leftovers(sweep, None, set(), set())
    assert report.processes == [] and calls == [] and report.killed_rows() == []


async def test_a_recorded_pid_that_names_another_process_now_is_not_counted(
    procs: Procs,
) -> None:
    other = procs.start("sleeper")
    reused = ProcessIdentity(other.pid, other.create_time - 100.0)
    po = owner()
    report = await sweep_leftovers(po.sweep, None, {reused}, set())
    assert report.processes == [] and alive(other)


async def test_a_process_surviving_sigkill_is_reported_not_counted(procs: Procs) -> None:
    victim = start_ours(procs, "sglang::scheduler_TP0")

    async def sweep(idents: set[ProcessIdentity]) -> list[ProcessIdentity]:
        return sorted(idents)  # as if stuck in D state: everything survives

    report = await sweep_leftovers(sweep, None, {victim}, set(), match=("sglang",))
    assert [p.killed for p in report.processes] == [False]
    assert report.killed_rows() == [] and report.stuck == [victim]
