"""The NVML adapter over a stand-in pynvml module, the real pynvml where there is no driver, and
the simulation's own rules."""

from __future__ import annotations

import ctypes.util
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from supervisor.gpu import sim as gpu_sim
from supervisor.gpu.nvml import GiB, MiB, NvmlUnavailable, PynvmlNvml
from supervisor.gpu.sim import SimulatedNvml, gpus_of, open_nvml, simulated_uuid
from testkit.gpu import HOLDER, Procs


class StubError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class Mem:
    used: int
    total: int


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None  # pynvml spells it so


@dataclass
class StubLib:
    """Just the pynvml calls the adapter makes, with errors to order."""

    gpus: int = 2
    v2: bool = True
    init_error: int | None = None
    lost: int | None = None
    calls: list[str] = field(default_factory=list)
    NVMLError = StubError
    nvmlMemory_v2 = 0x02000028

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise StubError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i == self.lost:
            raise StubError(15)
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> Mem:
        if version is not None:
            self.calls.append("v2")
            if not self.v2:
                raise StubError(13)
            return Mem(used=(h + 1) * GiB, total=141 * GiB)
        self.calls.append("v1")
        # v1 counts driver-reserved memory as used.
        return Mem(used=(h + 1) * GiB + 500 * MiB, total=141 * GiB)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Proc]:
        return [Proc(100 + h, GiB), Proc(200 + h, None)]

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return f"GPU-{h:08x}".encode()  # older pynvml returns bytes

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA H200"


def test_snapshot_uses_memory_v2_and_keys_by_uuid() -> None:
    lib = StubLib()
    snaps = PynvmlNvml(lib).snapshot()
    assert [(s.index, s.uuid, s.name, s.memory_used_bytes) for s in snaps] == [
        (0, "GPU-00000000", "NVIDIA H200", GiB),
        (1, "GPU-00000001", "NVIDIA H200", 2 * GiB),
    ]
    assert [(p.pid, p.used_bytes) for p in snaps[1].processes] == [(101, GiB), (201, None)]
    assert lib.calls == ["v2", "v2"]


def test_memory_falls_back_to_v1_once_when_v2_is_missing() -> None:
    lib = StubLib(v2=False)
    nvml = PynvmlNvml(lib)
    assert nvml.snapshot()[0].memory_used_bytes == GiB + 500 * MiB
    nvml.snapshot()
    assert lib.calls == ["v2", "v1", "v1", "v1", "v1"]


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (12, ["libnvidia-ml.so.1", "gpus.manage: false"]),
        (9, ["kernel driver is not loaded", "gpus.manage: false"]),
        (4, ["permission denied", f"uid {os.getuid()}", "gpus.manage: false"]),
        (18, ["reboot"]),
        (999, ["NVML error"]),
    ],
)
def test_init_errors_say_what_to_do(code: int, words: list[str]) -> None:
    with pytest.raises(NvmlUnavailable) as err:
        PynvmlNvml(StubLib(init_error=code))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_lost_gpu_is_named() -> None:
    with pytest.raises(NvmlUnavailable) as err:
        PynvmlNvml(StubLib(lost=1)).snapshot()
    assert str(err.value).startswith("GPU 1: the GPU is lost")


def test_close_shuts_nvml_down_once() -> None:
    lib = StubLib()
    nvml = PynvmlNvml(lib)
    nvml.close()
    nvml.close()
    assert lib.calls == ["shutdown"]


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None or os.path.exists("/dev/nvidiactl"),
    reason="this machine has an NVIDIA driver",
)
def test_real_pynvml_without_a_driver_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gpu_sim.ENV_GPUS, raising=False)
    with pytest.raises(NvmlUnavailable) as err:
        open_nvml()
    assert "gpus.manage: false" in str(err.value)


# ------------------------------------------------------------------------- the simulation


def test_gpus_of_reads_scheduler_titles_and_markers() -> None:
    assert gpus_of(["python", "x.py", "sglang::scheduler_TP3"]) == {3}
    # After setproctitle the title is the first argument and the rest of argv is blank.
    assert gpus_of(["sglang::scheduler_TP3", "", ""]) == {3}
    assert gpus_of(["sglang::scheduler"]) == {0}
    assert gpus_of(["python", "sglang::scheduler_TP3", "more"]) == set()
    assert gpus_of(["x", "--sim-gpu", "0", "--sim-gpu", "2"]) == {0, 2}
    assert gpus_of(["x", "--sim-gpu"]) == set()
    assert gpus_of([]) == set()


def test_open_nvml_gives_the_simulation_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(gpu_sim.ENV_GPUS, "4")
    monkeypatch.setenv(gpu_sim.ENV_MIB, "100")
    monkeypatch.setenv(gpu_sim.ENV_WEDGED, "1:2048, 3:512")
    monkeypatch.setenv(gpu_sim.ENV_TAG, "t")
    nvml = open_nvml()
    assert nvml == SimulatedNvml(gpus=4, mib_per_process=100, wedged_mib={1: 2048, 3: 512}, tag="t")
    monkeypatch.setenv(gpu_sim.ENV_WEDGED, "2048")
    assert isinstance(n := open_nvml(), SimulatedNvml) and n.wedged_mib == {0: 2048}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (gpu_sim.ENV_GPUS, "two"),
        (gpu_sim.ENV_GPUS, "0"),
        (gpu_sim.ENV_MIB, "-1"),
        (gpu_sim.ENV_WEDGED, "9:100"),
        (gpu_sim.ENV_WEDGED, "a:100"),
        (gpu_sim.ENV_TAG, ""),
    ],
)
def test_simulation_settings_are_checked(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(gpu_sim.ENV_GPUS, "2")
    monkeypatch.setenv(gpu_sim.ENV_TAG, "t")
    monkeypatch.setenv(name, value)
    with pytest.raises(NvmlUnavailable) as err:
        open_nvml()
    assert name in str(err.value)


def test_simulation_sees_only_live_processes_with_its_tag(procs: Procs) -> None:
    sim = SimulatedNvml(gpus=2, mib_per_process=512, wedged_mib={1: 100}, tag=procs.tag)
    a = procs.start("sglang::scheduler_TP0")
    b = procs.start("worker", "--sim-gpu", "1", "--sim-gpu", "0")
    procs.start("sglang::scheduler_TP5")  # no such simulated GPU
    # Same marker, another tag: another test's process.
    other = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "sglang::scheduler_TP0"],
        stdout=subprocess.PIPE,
        env={**os.environ, gpu_sim.ENV_TAG: "someone-else"},
    )
    try:
        assert other.stdout is not None and other.stdout.readline().startswith(b"ready")
        snaps = sim.snapshot()
    finally:
        other.kill()
        other.wait()
        assert other.stdout is not None
        other.stdout.close()
    assert [[p.pid for p in s.processes] for s in snaps] == [sorted([a.pid, b.pid]), [b.pid]]
    assert [s.memory_used_bytes for s in snaps] == [1024 * MiB, 612 * MiB]
    assert snaps[1].uuid == simulated_uuid(1)

    # A killed process frees its memory at once, even unreaped (a zombie), as on an H200.
    os.kill(a.pid, signal.SIGKILL)
    os.waitid(os.P_PID, a.pid, os.WEXITED | os.WNOWAIT)
    assert [p.pid for p in sim.snapshot()[0].processes] == [b.pid]


def test_simulation_close_is_harmless() -> None:
    SimulatedNvml(gpus=1).close()
