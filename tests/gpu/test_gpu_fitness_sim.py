"""Fitness against the simulated NVML with several GPUs: every condition, devices by index and
by UUID, the check before a launch, and the Xid watcher task with its per-GPU metrics."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.machine import GpuFault, GpuUnfit
from supervisor.gpu.fitness import NOT_SUPPORTED
from supervisor.gpu.fitness_watch import Monitor
from supervisor.gpu.nvml import NvmlUnavailable
from supervisor.gpu.sim import SimulatedNvml, parse_health, simulated_uuid
from supervisor.metrics import Metrics
from testkit.wait import wait_until_async

GPUS = 8


def sim(tmp_path: Path, spec: str = "", gpus: int = GPUS) -> tuple[SimulatedNvml, Path, Path]:
    health, xids = tmp_path / "health", tmp_path / "xids"
    health.write_text(spec)
    xids.write_text("")
    return (
        SimulatedNvml(gpus=gpus, tag="fitness-test", health_spec=f"@{health}", xid_file=str(xids)),
        health,
        xids,
    )


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_each_condition_reads_as_the_driver_would_report_it(tmp_path: Path) -> None:
    s, _, _ = sim(
        tmp_path,
        "1:lost,2:recovery=1,3:recovery=2,4:remap_pending,5:remap_failure,6:ecc=3,7:unsupported",
    )
    reads = {r.index: r for r in s.health()}
    assert reads[0].recovery_action == 0 and reads[0].remapped_pending is False
    assert reads[1].lost
    assert reads[2].recovery_action == 1 and reads[3].recovery_action == 2
    assert reads[4].remapped_pending is True and reads[5].remapped_failure is True
    assert reads[6].ecc_uncorrected_volatile == 3
    assert reads[7].recovery_action is NOT_SUPPORTED
    assert [r.uuid for r in reads.values()] == [simulated_uuid(i) for i in range(GPUS)]


def test_from_env_checks_the_conditions_at_once() -> None:
    env = {"KIMI_SERVE_SIMULATED_GPUS": "2", "KIMI_SERVE_SIM_TAG": "t"}
    with pytest.raises(NvmlUnavailable, match="expected GPU:CONDITION"):
        SimulatedNvml.from_env({**env, "KIMI_SERVE_SIMULATED_GPU_HEALTH": "3:lost"})
    ok = SimulatedNvml.from_env({**env, "KIMI_SERVE_SIMULATED_GPU_HEALTH": "1:ecc=2"})
    assert ok.health()[1].ecc_uncorrected_volatile == 2


def test_a_lost_gpu_also_fails_the_process_snapshot(tmp_path: Path) -> None:
    s, _, _ = sim(tmp_path, "5:lost")
    with pytest.raises(NvmlUnavailable, match="GPU 5: the GPU is lost"):
        s.snapshot()


@pytest.mark.parametrize("bad", ["9:lost", "1:melted", "x:lost", "1:ecc", "1:lost=2"])
def test_a_misspelt_condition_is_an_error(bad: str) -> None:
    with pytest.raises(NvmlUnavailable, match="expected GPU:CONDITION"):
        parse_health(bad, GPUS)


async def test_before_launch_fit_then_unfit_names_gpu_uuid_and_action(tmp_path: Path) -> None:
    s, health, _ = sim(tmp_path)
    m = Metrics()
    mon = Monitor(s, "all", lambda _e: None, gauge=m.set_gpu_healthy)
    assert await mon.before_launch() is None
    for i in range(GPUS):
        assert sample(m, "kimi_serve_gpu_healthy", gpu=str(i), UUID=simulated_uuid(i)) == 1
    health.write_text("3:remap_pending,6:remap_failure")
    got = await mon.before_launch()
    assert isinstance(got, GpuUnfit)
    assert got.line.startswith(f"GPU 6 ({simulated_uuid(6)}) needs a replace: ")
    assert f"GPU 3 ({simulated_uuid(3)}) needs a reset: row remapping pending" in got.line
    assert sample(m, "kimi_serve_gpu_healthy", gpu="3", UUID=simulated_uuid(3)) == 0
    assert sample(m, "kimi_serve_gpu_healthy", gpu="2", UUID=simulated_uuid(2)) == 1
    status = mon.health_by_index()
    assert status[3]["ok"] is False and status[3]["remapped_rows"]["pending"] is True


@pytest.mark.parametrize(
    "devices", [(0, 1, 2), (simulated_uuid(2), simulated_uuid(0), simulated_uuid(1))]
)
async def test_a_gpu_outside_gpus_devices_is_never_judged(
    tmp_path: Path, devices: tuple[Any, ...]
) -> None:
    s, _, _ = sim(tmp_path, "5:lost,7:remap_failure")
    m = Metrics()
    mon = Monitor(s, devices, lambda _e: None, gauge=m.set_gpu_healthy)
    assert await mon.before_launch() is None
    assert sorted(mon.health_by_index()) == [0, 1, 2]
    assert sample(m, "kimi_serve_gpu_healthy", gpu="5", UUID=simulated_uuid(5)) is None


async def test_unsupported_fields_leave_a_gpu_fit_and_say_so(tmp_path: Path) -> None:
    s, _, _ = sim(tmp_path, "0:unsupported", gpus=1)
    mon = Monitor(s, "all", lambda _e: None)
    assert await mon.before_launch() is None
    h = mon.health_by_index()[0]
    assert h["recovery_action"] == "not_supported" and "recovery_action" in h["not_supported"]


async def test_watcher_reports_xids_per_gpu_and_restarts_only_when_needed(tmp_path: Path) -> None:
    s, health, xids = sim(tmp_path)
    posted: list[Any] = []
    m = Metrics()
    devices = tuple(range(GPUS - 1))  # GPU 7 is not ours
    mon = Monitor(s, devices, posted.append, gauge=m.set_gpu_healthy, count_xid=m.count_xid)
    # Events only: no fitness read without one during this test.
    watch = mon.watch(s.open_events(), slice_s=0.1, poll_s=3600)
    task = asyncio.get_running_loop().create_task(watch)
    try:
        # An application's Xid on GPU 1: reported, no restart.
        with xids.open("a") as f:
            f.write("1:31\n")
        await wait_until_async(lambda: len(posted) == 1, 10.0, "the first fault")
        assert posted[0] == GpuFault(
            f"GPU 1 ({simulated_uuid(1)}): Xid 31 (GPU memory page fault); "
            "the driver asks for no action",
            restart=False,
        )
        # GPU 7 is outside gpus.devices: nothing.
        with xids.open("a") as f:
            f.write("7:79\n")
        # GPU 4 falls off the bus: restart.
        health.write_text("4:lost")
        with xids.open("a") as f:
            f.write("4:79\n")
        await wait_until_async(lambda: len(posted) == 2, 10.0, "the second fault")
        assert posted[1].restart is True
        assert posted[1].line.startswith(f"GPU 4 ({simulated_uuid(4)}) needs a reboot")
        assert "last event Xid 79" in posted[1].line
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    xid = "kimi_serve_gpu_xid_events_total"
    assert sample(m, xid, gpu="1", UUID=simulated_uuid(1), xid="31") == 1
    assert sample(m, xid, gpu="4", UUID=simulated_uuid(4), xid="79") == 1
    assert sample(m, xid, gpu="7", UUID=simulated_uuid(7), xid="79") is None
    assert sample(m, "kimi_serve_gpu_healthy", gpu="4", UUID=simulated_uuid(4)) == 0
    assert mon.health_by_index()[4]["last_xid"]["xid"] == 79


async def test_a_gpu_unfit_with_no_event_is_reported_once_at_the_next_read(
    tmp_path: Path,
) -> None:
    # A recovery action, an ECC count: the driver may raise no critical event for them.
    s, health, _ = sim(tmp_path, gpus=2)
    posted: list[Any] = []
    m = Metrics()
    mon = Monitor(s, "all", posted.append, gauge=m.set_gpu_healthy)
    await mon.assess()  # as before the launch: both fit
    task = asyncio.get_running_loop().create_task(
        mon.watch(s.open_events(), slice_s=0.05, poll_s=0.1)
    )
    healthy = "kimi_serve_gpu_healthy"
    try:
        health.write_text("1:recovery=1")
        await wait_until_async(lambda: len(posted) == 1, 10.0, "the first report")
        assert posted[0].restart is True
        assert posted[0].line.startswith(f"GPU 1 ({simulated_uuid(1)}) needs a reset")
        assert mon.health_by_index()[1]["recovery_action"] != "none"
        # GPU 1 unfit as before is not news; GPU 0 newly unfit is (after many more reads).
        health.write_text("1:recovery=1,0:ecc=2")
        await wait_until_async(lambda: len(posted) == 2, 10.0, "the second report")
        assert "GPU 0" in posted[1].line and "2 uncorrectable ECC error(s)" in posted[1].line
        # Fit again: /status and the metric say so without an event; nothing is posted.
        health.write_text("")
        await wait_until_async(
            lambda: sample(m, healthy, gpu="1", UUID=simulated_uuid(1)) == 1,
            10.0,
            "GPU 1 healthy again",
        )
        assert mon.health_by_index()[0]["ok"] is True and len(posted) == 2
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_watcher_cancel_returns_within_a_slice_and_never_blocks_the_loop(
    tmp_path: Path,
) -> None:
    s, _, _ = sim(tmp_path, gpus=2)
    events = s.open_events()
    mon = Monitor(s, "all", lambda _e: None)
    task = asyncio.get_running_loop().create_task(mon.watch(events, slice_s=0.5))
    t = time.monotonic()
    for _ in range(10):  # the loop keeps turning while the waits block in their thread
        await asyncio.sleep(0.02)
    assert time.monotonic() - t < 0.45
    t = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - t < 1.0
    assert events._closed


async def test_a_corrected_ecc_event_is_news_only_when_the_gpu_is_unfit(tmp_path: Path) -> None:
    from supervisor.gpu.fitness import XidEvent

    s, health, _ = sim(tmp_path, gpus=2)
    posted: list[Any] = []
    mon = Monitor(s, "all", posted.append)
    await mon.on_event(XidEvent(0, simulated_uuid(0), "ecc_single_bit", 0, 1.0))
    assert posted == [] and mon.last_xids == {}
    health.write_text("0:ecc=1")
    await mon.on_event(XidEvent(0, simulated_uuid(0), "ecc_double_bit", 0, 2.0))
    assert len(posted) == 1 and posted[0].restart is False
    assert "1 uncorrectable ECC error(s)" in posted[0].line
