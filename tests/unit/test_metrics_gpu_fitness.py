"""kimi_serve_gpu_healthy from the GPU snapshot and from verdicts; the Xid counter; leftovers
counted per GPU with gpu="none" for those that held no GPU memory."""

from __future__ import annotations

from typing import Any

from supervisor.gpu.fitness import HealthRead
from supervisor.gpu.nvml import GpuSnapshot, gpu_status
from supervisor.metrics import Metrics


def snap(index: int, health: HealthRead | None) -> GpuSnapshot:
    return GpuSnapshot(index, f"GPU-{index}", "H200", 0, 1, (), health=health)


def fit(index: int, **over: Any) -> HealthRead:
    base: dict[str, Any] = dict(
        recovery_action=0,
        remapped_pending=False,
        remapped_failure=False,
        remapped_uncorrectable=0,
        remapped_correctable=0,
        ecc_uncorrected_volatile=0,
    )
    base.update(over)
    return HealthRead(index, f"GPU-{index}", lost=False, **base)


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_healthy_is_read_from_the_snapshot_at_scrape_time() -> None:
    snaps = [snap(0, fit(0)), snap(1, fit(1, remapped_pending=True)), snap(2, None)]
    m = Metrics(gpu_snapshot=lambda: gpu_status(snaps))
    assert value(m, "kimi_serve_gpu_healthy", gpu="0", UUID="GPU-0") == 1
    assert value(m, "kimi_serve_gpu_healthy", gpu="1", UUID="GPU-1") == 0
    # No health read: no verdict exported, rather than a made-up one.
    assert value(m, "kimi_serve_gpu_healthy", gpu="2", UUID="GPU-2") is None
    assert gpu_status(snaps)[1]["health"]["remapped_rows"]["pending"] is True
    assert "health" not in gpu_status(snaps)[2]


def test_a_verdict_wins_over_the_snapshot_and_covers_a_gpu_no_longer_listed() -> None:
    m = Metrics(gpu_snapshot=lambda: gpu_status([snap(0, fit(0))]))
    m.set_gpu_healthy(0, "GPU-0", False)
    m.set_gpu_healthy(3, "GPU-3", False)  # lost: the snapshot cannot list it any more
    assert value(m, "kimi_serve_gpu_healthy", gpu="0", UUID="GPU-0") == 0
    assert value(m, "kimi_serve_gpu_healthy", gpu="3", UUID="GPU-3") == 0


def test_xid_and_leftover_counters() -> None:
    m = Metrics()
    m.count_xid(4, "GPU-4", 79)
    m.count_xid(4, "GPU-4", 79)
    assert value(m, "kimi_serve_gpu_xid_events_total", gpu="4", UUID="GPU-4", xid="79") == 2
    m.count_leftovers([("0", "GPU-0", 2), ("none", "none", 1)])
    m.count_leftovers([("0", "GPU-0", 1)])
    name = "kimi_serve_gpu_leftover_processes_killed_total"
    assert value(m, name, gpu="0", UUID="GPU-0") == 3
    assert value(m, name, gpu="none", UUID="none") == 1


def test_kimi_serve_status_names_an_unfit_gpu_and_its_action() -> None:
    from supervisor.admin.status_command import render

    snaps = [snap(0, fit(0)), snap(1, fit(1, remapped_failure=True))]
    text = render({"state": "failed", "gpus": gpu_status(snaps)}, now=0.0)
    lines = [line for line in text.splitlines() if "GPU " in line]
    assert "NEEDS" not in lines[0]
    assert lines[1].endswith("NEEDS A REPLACE: row remapping failed (no spare rows left)")
