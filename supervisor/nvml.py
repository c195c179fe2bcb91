"""NVML behind a two-method interface: which processes hold memory on which GPU.

kimi-serve asks NVML one question, for GPU cleaning, the GPU-count preflight check and the
per-GPU metrics. `Nvml` is that question as an interface with two implementations: the real
NVML through nvidia-ml-py (`PynvmlNvml`), and a simulation (`gpu_sim`) for machines with no GPU,
so everything above it is tested without one. The driver's errors become `NvmlUnavailable`
with advice an operator can act on.

GPUs are keyed by UUID: indexes shift with `CUDA_VISIBLE_DEVICES`, UUIDs do not
(docs/sglang.md, "GPUs").
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # a host pid, also inside containers (docs/sglang.md, "GPUs")
    used_bytes: int | None  # None: the driver does not say (e.g. without permission)


@dataclass(frozen=True)
class GpuSnapshot:
    index: int  # NVML's index, which ignores CUDA_VISIBLE_DEVICES
    uuid: str
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    processes: tuple[GpuProcess, ...]


class NvmlUnavailable(Exception):
    """NVML cannot answer: no driver, no permission, a GPU lost. The message says what to do."""


class UnknownDevice(NvmlUnavailable):
    """`gpus.devices` names a GPU this host does not have."""


class Nvml(Protocol):
    def snapshot(self) -> list[GpuSnapshot]: ...

    def close(self) -> None: ...


# nvmlReturn_t values (nvml.h) that deserve their own advice.
_NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_LIB_RM_VERSION_MISMATCH = 18
_ARGUMENT_VERSION_MISMATCH = 25
_OFF = "or set gpus.manage: false on a machine without NVIDIA GPUs"


def _advice(exc: Exception, gpu: int | None) -> str:
    code = getattr(exc, "value", None)
    where = f"GPU {gpu}: " if gpu is not None else ""
    if code == _LIBRARY_NOT_FOUND:
        return (
            "NVML is not available: the NVIDIA driver library libnvidia-ml.so.1 was not found; "
            f"install the NVIDIA driver, {_OFF}"
        )
    if code == _DRIVER_NOT_LOADED:
        return f"NVML is not available: the NVIDIA kernel driver is not loaded; load it, {_OFF}"
    if code == _NO_PERMISSION:
        return (
            f"{where}NVML says permission denied: user uid {os.getuid()} cannot use the GPUs "
            f"(/dev/nvidia*); run kimi-serve as a user with GPU access, {_OFF}"
        )
    if code == _GPU_IS_LOST:
        return (
            f"{where}the GPU is lost (fell off the bus, see dmesg for Xid 79); "
            "it needs a GPU reset or a reboot before anything can run on it"
        )
    if code == _LIB_RM_VERSION_MISMATCH:
        return (
            "NVML is not available: the NVIDIA driver library and kernel module versions differ "
            "(driver upgraded without a reboot); reboot the host"
        )
    return f"{where}NVML error: {exc}"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PynvmlNvml:
    """The real NVML through nvidia-ml-py. Open once per process; `close()` at exit.

    `lib` is the pynvml module; a test passes a stand-in to reach the error paths.
    """

    def __init__(self, lib: Any = None) -> None:
        self._lib = lib if lib is not None else importlib.import_module("pynvml")
        lib = self._lib
        self._memory_v2 = hasattr(lib, "nvmlMemory_v2")
        try:
            lib.nvmlInit()
        except lib.NVMLError as exc:
            raise NvmlUnavailable(_advice(exc, None)) from None
        self._open = True

    def _memory(self, handle: object) -> tuple[int, int]:
        lib = self._lib
        if self._memory_v2:
            # v1's `used` counts driver-reserved memory since R510: an empty H200 would look
            # busy against a small threshold. v2 reports it apart (docs/sglang.md, "GPUs").
            try:
                mem = lib.nvmlDeviceGetMemoryInfo(handle, version=lib.nvmlMemory_v2)
                return int(mem.used), int(mem.total)
            except lib.NVMLError as exc:
                if getattr(exc, "value", None) not in (
                    _FUNCTION_NOT_FOUND,
                    _ARGUMENT_VERSION_MISMATCH,
                ):
                    raise
                self._memory_v2 = False
        mem = lib.nvmlDeviceGetMemoryInfo(handle)
        return int(mem.used), int(mem.total)

    def snapshot(self) -> list[GpuSnapshot]:
        lib = self._lib
        out = []
        index: int | None = None
        try:
            for index in range(lib.nvmlDeviceGetCount()):
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                used, total = self._memory(handle)
                procs = tuple(
                    GpuProcess(
                        int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)
                    )
                    for p in lib.nvmlDeviceGetComputeRunningProcesses(handle)
                )
                out.append(
                    GpuSnapshot(
                        index=index,
                        uuid=_text(lib.nvmlDeviceGetUUID(handle)),
                        name=_text(lib.nvmlDeviceGetName(handle)),
                        memory_used_bytes=used,
                        memory_total_bytes=total,
                        processes=procs,
                    )
                )
        except lib.NVMLError as exc:
            raise NvmlUnavailable(_advice(exc, index)) from None
        return out

    def close(self) -> None:
        if self._open:
            self._open = False
            with contextlib.suppress(self._lib.NVMLError):
                self._lib.nvmlShutdown()


# Opens an NVML (raises NvmlUnavailable): `PynvmlNvml` in production; the command line picks
# the simulation instead where it is asked for (`gpu_sim.open_nvml`).
NvmlOpener = Callable[[], Nvml]


def select(
    snapshots: Sequence[GpuSnapshot], devices: str | tuple[int | str, ...]
) -> list[GpuSnapshot]:
    """The managed GPUs (`gpus.devices`: "all", indexes or UUIDs). Raises UnknownDevice."""
    if devices == "all":
        return sorted(snapshots, key=lambda s: s.index)
    by_index = {s.index: s for s in snapshots}
    by_uuid = {s.uuid.lower(): s for s in snapshots}
    out: list[GpuSnapshot] = []
    missing: list[str] = []
    for dev in devices:
        snap = by_index.get(dev) if isinstance(dev, int) else by_uuid.get(dev.lower())
        if snap is None:
            missing.append(str(dev))
        elif snap not in out:
            out.append(snap)
    if missing:
        have = ", ".join(f"{s.index} ({s.uuid})" for s in sorted(snapshots, key=lambda s: s.index))
        raise UnknownDevice(
            f"gpus.devices names {', '.join(missing)}, which NVML does not list on this host "
            f"(it has: {have or 'no GPUs'}); fix gpus.devices (NVML indexes ignore "
            "CUDA_VISIBLE_DEVICES; `nvidia-smi -L` lists indexes and UUIDs)"
        )
    return out


def gpu_status(snapshots: Iterable[GpuSnapshot]) -> list[dict[str, Any]]:
    """The admin /status `gpus` list (and the per-GPU metrics)."""
    return [
        {
            "index": s.index,
            "uuid": s.uuid,
            "name": s.name,
            "memory_used_bytes": s.memory_used_bytes,
            "memory_total_bytes": s.memory_total_bytes,
            "processes": [p.pid for p in s.processes],
        }
        for s in snapshots
    ]
