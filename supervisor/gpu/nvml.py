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
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from supervisor.gpu import fitness

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
    # The fitness fields, read with the snapshot (a few NVML calls, well under a millisecond);
    # None where they could not be read.
    health: fitness.HealthRead | None = None


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
        # index -> UUID as last read: a lost GPU can no longer say its UUID, its verdict must.
        self._uuids: dict[int, str] = {}
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
                uuid = self._uuids[index] = _text(lib.nvmlDeviceGetUUID(handle))
                health: fitness.HealthRead | None
                try:
                    health = read_health(lib, index, uuid)
                except lib.NVMLError:
                    health = None  # the processes still count; fitness says it could not read
                out.append(
                    GpuSnapshot(
                        index=index,
                        uuid=uuid,
                        name=_text(lib.nvmlDeviceGetName(handle)),
                        memory_used_bytes=used,
                        memory_total_bytes=total,
                        processes=procs,
                        health=health,
                    )
                )
        except lib.NVMLError as exc:
            raise NvmlUnavailable(_advice(exc, index)) from None
        return out

    def health(self) -> list[fitness.HealthRead]:
        """The fitness fields of every GPU (a lost one reads as lost, not as an error)."""
        lib = self._lib
        out = []
        index: int | None = None
        try:
            for index in range(lib.nvmlDeviceGetCount()):
                read = read_health(lib, index, self._uuids.get(index, "unknown"))
                if read.uuid != "unknown":
                    self._uuids[index] = read.uuid
                out.append(read)
        except lib.NVMLError as exc:
            raise NvmlUnavailable(_advice(exc, index)) from None
        return out

    def open_events(self) -> PynvmlEvents:
        try:
            return PynvmlEvents(self._lib, self._uuids)
        except self._lib.NVMLError as exc:
            raise NvmlUnavailable(_advice(exc, None)) from None

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
            **({} if s.health is None else {"health": fitness.assess(s.health).health()}),
        }
        for s in snapshots
    ]


# --------------------------------------------------------------------------------------------
# Fitness: the health fields and the critical-event set (docs/gpu.md, "GPU fitness")
# --------------------------------------------------------------------------------------------

_NOT_SUPPORTED = 3
_TIMEOUT = 10
_FI_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
# NVML_VALUE_TYPE_* -> the c_nvmlValue_t member holding it
_VALUE_MEMBER = {
    0: "dVal",
    1: "uiVal",
    2: "ulVal",
    3: "ullVal",
    4: "sllVal",
    5: "siVal",
    6: "usVal",
}
# Critical events: Xid, double/single-bit ECC, the driver's recovery action (measured on H200:
# the mask 32779 registers on driver 580).
EVENT_XID = 0x8
EVENT_ECC_DOUBLE = 0x2
EVENT_ECC_SINGLE = 0x1
EVENT_RECOVERY = 0x8000
EVENT_MASK = EVENT_XID | EVENT_ECC_DOUBLE | EVENT_ECC_SINGLE | EVENT_RECOVERY
_EVENT_KIND = {
    EVENT_XID: "xid",
    EVENT_ECC_DOUBLE: "ecc_double_bit",
    EVENT_ECC_SINGLE: "ecc_single_bit",
    EVENT_RECOVERY: "recovery_action",
}


def event_kind(event_type: int) -> str:
    return _EVENT_KIND.get(event_type, "other")


class HealthSource(Protocol):
    """The fitness half of NVML: both `PynvmlNvml` and the simulation implement it."""

    def health(self) -> list[fitness.HealthRead]: ...

    def open_events(self) -> EventSource: ...


class EventSource(Protocol):
    def wait(self, timeout_ms: int) -> list[fitness.XidEvent]:
        """Block up to timeout_ms for critical events; [] when none came. Thread-safe with close."""
        ...

    def close(self) -> None: ...


def _code(exc: Exception) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


class PynvmlEvents:
    """An NVML event set over every GPU, registered for the critical events each supports.

    `wait()` blocks in the driver, so it runs in the thread adapter, in short slices; `close()`
    takes the same lock, so the set is never freed under a waiting thread.
    """

    def __init__(self, lib: Any, uuids: Mapping[int, str]) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self._set = lib.nvmlEventSetCreate()
        self.registered: dict[int, int] = {}  # index -> mask registered
        self.unsupported: dict[int, str] = {}  # index -> why nothing could be registered
        self._uuids = dict(uuids)
        for index in range(lib.nvmlDeviceGetCount()):
            try:
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                self._uuids[index] = _text(lib.nvmlDeviceGetUUID(handle))
                mask = EVENT_MASK & int(lib.nvmlDeviceGetSupportedEventTypes(handle))
                if mask:
                    lib.nvmlDeviceRegisterEvents(handle, mask, self._set)
                    self.registered[index] = mask
                else:
                    self.unsupported[index] = "none of the critical event types is supported"
            except lib.NVMLError as exc:
                self.unsupported[index] = str(exc)
        self._closed = False

    def wait(self, timeout_ms: int) -> list[fitness.XidEvent]:
        lib = self._lib
        with self._lock:
            if self._closed:
                return []
            try:
                data = lib.nvmlEventSetWait_v2(self._set, timeout_ms)
            except lib.NVMLError as exc:
                if _code(exc) == _TIMEOUT:
                    return []
                raise NvmlUnavailable(_advice(exc, None)) from None
            try:
                uuid = _text(lib.nvmlDeviceGetUUID(data.device))
            except lib.NVMLError:
                uuid = "unknown"
            index = next((i for i, u in self._uuids.items() if u == uuid), -1)
            return [
                fitness.XidEvent(
                    index=index,
                    uuid=uuid,
                    kind=event_kind(int(data.eventType)),
                    xid=int(data.eventData),
                    at=time.time(),
                )
            ]

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(self._lib.NVMLError):
                    self._lib.nvmlEventSetFree(self._set)


def _field_value(v: Any) -> int:
    member = _VALUE_MEMBER.get(int(v.valueType), "ullVal")
    return int(getattr(v.value, member))


def read_health(lib: Any, index: int, uuid: str) -> fitness.HealthRead:
    """Every fitness field of one GPU; NOT_SUPPORTED where the GPU or driver says so.

    Raises lib.NVMLError for anything else but "lost", which is an answer, not an error.
    """
    ns = fitness.NOT_SUPPORTED

    def unsupported(exc: Exception) -> bool:
        # AttributeError: an nvidia-ml-py too old to have the call at all.
        return isinstance(exc, AttributeError) or _code(exc) in (
            _NOT_SUPPORTED,
            _FUNCTION_NOT_FOUND,
        )

    try:
        handle = lib.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(lib.nvmlDeviceGetUUID(handle))
        recovery: fitness.Reading = ns
        try:
            # An array of c_nvmlFieldValue_t (ctypes): index it; each carries its own return.
            values = lib.nvmlDeviceGetFieldValues(handle, [_FI_RECOVERY_ACTION])
            v = values[0]
            if int(v.nvmlReturn) == 0:
                recovery = _field_value(v)
            elif int(v.nvmlReturn) == _GPU_IS_LOST:
                return fitness.HealthRead(index, uuid, lost=True)
            elif int(v.nvmlReturn) not in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                raise lib.NVMLError(int(v.nvmlReturn))
        except (lib.NVMLError, AttributeError) as exc:
            if not unsupported(exc):
                raise
        rows: tuple[fitness.Reading, fitness.Reading, fitness.Flag, fitness.Flag]
        rows = (ns, ns, ns, ns)
        try:
            corr, unc, pending, failure = lib.nvmlDeviceGetRemappedRows(handle)
            rows = (int(corr), int(unc), bool(pending), bool(failure))
        except (lib.NVMLError, AttributeError) as exc:
            if not unsupported(exc):
                raise
        ecc: fitness.Reading = ns
        try:
            current, _pending = lib.nvmlDeviceGetEccMode(handle)
            if current:  # with ECC off the counters mean nothing
                ecc = int(
                    lib.nvmlDeviceGetTotalEccErrors(
                        handle, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC
                    )
                )
        except (lib.NVMLError, AttributeError) as exc:
            if not unsupported(exc):
                raise
    except lib.NVMLError as exc:
        if _code(exc) == _GPU_IS_LOST:
            return fitness.HealthRead(index, uuid, lost=True)
        raise
    return fitness.HealthRead(
        index=index,
        uuid=uuid,
        lost=False,
        recovery_action=recovery,
        remapped_correctable=rows[0],
        remapped_uncorrectable=rows[1],
        remapped_pending=rows[2],
        remapped_failure=rows[3],
        ecc_uncorrected_volatile=ecc,
    )
