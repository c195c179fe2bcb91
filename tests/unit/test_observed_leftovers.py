"""/status.leftovers over the cleanings before a launch (supervisor.daemon.observed)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from supervisor import config
from supervisor.core.machine import Context
from supervisor.daemon.observed import Observed
from supervisor.gpu import SweepReport, SweptProcess
from supervisor.metrics import Metrics


def observed(tmp_path: Path) -> tuple[Observed, Metrics]:
    (tmp_path / "m").mkdir()
    cfg = config.parse(f"sglang:\n  model_path: {tmp_path / 'm'}\n", "kimi-serve.yaml")
    metrics = Metrics()
    return Observed(cfg, Context(), metrics, clock=lambda: 0.0, wall=lambda: 0.0), metrics


def swept(*pids: int) -> SweepReport:
    return SweepReport(
        processes=[
            SweptProcess(
                p, 1.0, "launch record", "sglang::scheduler_TP0", ((0, "GPU-0", 1 << 30),), True
            )
            for p in pids
        ]
    )


def child() -> Any:
    return SimpleNamespace(started_at=1.0, alive=lambda: False)


def test_a_retried_cleaning_keeps_what_the_first_one_killed(tmp_path: Path) -> None:
    obs, metrics = observed(tmp_path)
    obs.swept(swept(101, 102))
    obs.swept(swept())  # the port was still held: the cleaning ran again and found nothing
    obs.launched(child())
    left = obs.status_document()["leftovers"]
    assert left["killed"] == {"0": 2}
    assert [p["pid"] for p in left["processes"]] == [101, 102]
    assert (
        metrics.registry.get_sample_value(
            "kimi_serve_gpu_leftover_processes_killed_total", {"gpu": "0", "UUID": "GPU-0"}
        )
        == 2
    )
    # The next launch's cleaning starts a new account.
    obs.swept(swept(103))
    left = obs.status_document()["leftovers"]
    assert left["killed"] == {"0": 1} and [p["pid"] for p in left["processes"]] == [103]
