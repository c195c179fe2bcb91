"""`kimi-serve gpu-clean`'s body: the launch record, the table, the exit status."""

from __future__ import annotations

import ctypes.util
import io
import os
import re
from pathlib import Path

import pytest

from supervisor.config import Config, parse
from supervisor.gpu import owner_marker, run_gpu_clean
from supervisor.gpu import sim as gpu_sim
from supervisor.process.identity import LaunchRecord, ProcessIdentity, RecordStore, live_process
from testkit.gpu import Procs


def config(state_dir: Path, gpus: str = "", timeout: str = "2s") -> Config:
    text = f"""
sglang: {{model_path: /models/kimi}}
state_dir: {state_dir}
gpus:
  memory_free_timeout: {timeout}
{gpus}
"""
    return parse(text, "kimi-serve.yaml")


def run(cfg: Config, dry_run: bool = False) -> tuple[int, str]:
    out = io.StringIO()
    code = run_gpu_clean(cfg, dry_run, out, gpu_sim.open_nvml)  # as the command line does
    return code, out.getvalue()


def row(text: str, pid: int, *cells: str) -> re.Match[str] | None:
    """The process table's row for pid, if its leading cells read `cells`."""
    pattern = rf"^  {pid} +" + " +".join(re.escape(c) for c in cells) + " "
    return re.search(pattern, text, re.MULTILINE)


def alive(ident: ProcessIdentity) -> bool:
    return live_process(ident) is not None


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch, procs: Procs) -> Procs:
    monkeypatch.setenv(gpu_sim.ENV_GPUS, "2")
    return procs


def test_management_off_does_nothing(tmp_path: Path) -> None:
    assert run(config(tmp_path, "  manage: false")) == (
        0,
        "GPU management is off (gpus.manage: false); nothing to do\n",
    )


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None or os.path.exists("/dev/nvidiactl"),
    reason="this machine has an NVIDIA driver",
)
def test_no_nvml_is_exit_1_with_a_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gpu_sim.ENV_GPUS, raising=False)
    code, text = run(config(tmp_path))
    assert code == 1
    assert text.startswith("error: NVML is not available") and "gpus.manage: false" in text
    assert "Traceback" not in text


def test_bad_simulation_setting_is_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gpu_sim.ENV_GPUS, "many")
    assert run(config(tmp_path)) == (
        1,
        "error: KIMI_SERVE_SIMULATED_GPUS='many' must be a whole number >= 1\n",
    )


def test_cleans_matching_and_recorded_leftovers(tmp_path: Path, simulated: Procs) -> None:
    leftover = simulated.start("sglang::scheduler_TP0", orphan=True)
    recorded = simulated.start("sglang::detokenizer")
    foreign = simulated.start("train.py")
    RecordStore(str(tmp_path)).save(
        LaunchRecord(daemon_pid=999_999_999, profile="primary", processes=(recorded,))
    )

    code, text = run(config(tmp_path))

    assert code == 0, text
    assert not alive(leftover) and not alive(recorded) and alive(foreign)
    assert "1 recorded from earlier launches" in text
    assert row(text, leftover.pid, "0", "4.0 GiB", "leftover", "SIGTERM: exited")
    assert row(text, recorded.pid, "-", "0 MiB", "leftover", "SIGTERM: exited")
    assert row(text, foreign.pid, "-", "0 MiB", "foreign", "-") is None  # holds no GPU memory
    assert "GPUs after:" in text
    assert text.splitlines()[-1].startswith(
        "ok: GPUs 0,1 free; removed 2 leftover process(es) (GPU 0: 1)"
    )


def test_dry_run_reports_and_exits_1_while_leftovers_hold_memory(
    tmp_path: Path, simulated: Procs
) -> None:
    leftover = simulated.start("sglang::scheduler_TP1")
    code, text = run(config(tmp_path), dry_run=True)
    assert code == 1 and alive(leftover)
    assert "dry run: would SIGTERM, then SIGKILL" in text
    assert text.splitlines()[-1].startswith("not clean: dry run: GPU 1 ")


def test_launch_of_the_daemon_owner_marker_is_ours(tmp_path: Path, simulated: Procs) -> None:
    simulated.env["KIMI_SERVE_OWNER"] = owner_marker(str(tmp_path))
    marked = simulated.start("python", "-m", "worker", "--sim-gpu", "0")
    code, text = run(config(tmp_path))
    assert code == 0, text
    assert not alive(marked)


def test_a_running_daemon_turns_it_into_a_report(tmp_path: Path, simulated: Procs) -> None:
    daemon = simulated.start("kimi-serve", "run")
    serving = simulated.start("sglang::scheduler_TP0")
    RecordStore(str(tmp_path)).save(
        LaunchRecord(daemon_pid=daemon.pid, profile="primary", processes=(serving,))
    )
    code, text = run(config(tmp_path))
    assert code == 1 and alive(serving)
    assert f"a kimi-serve daemon (pid {daemon.pid}) is running" in text
    assert row(text, serving.pid, "0", "4.0 GiB", "current", "-")


def test_remaining_memory_is_exit_1_naming_the_holder(tmp_path: Path, simulated: Procs) -> None:
    foreign = simulated.start("train.py", "--sim-gpu", "1")
    code, text = run(config(tmp_path, timeout="200ms"))
    assert code == 1 and alive(foreign)
    last = text.splitlines()[-1]
    assert last.startswith("not clean: GPU 1 (GPU-51a11a7e) still holds 4.0 GiB after")
    assert f"pid {foreign.pid} (foreign" in last
