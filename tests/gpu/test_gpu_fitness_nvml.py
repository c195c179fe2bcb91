"""The fitness half of the NVML adapter over a stand-in pynvml: each field, "not supported"
per field, a lost GPU, the ctypes array nvmlDeviceGetFieldValues returns, the event set."""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from supervisor.gpu import fitness
from supervisor.gpu.nvml import (
    EVENT_MASK,
    EVENT_XID,
    NvmlUnavailable,
    PynvmlEvents,
    PynvmlNvml,
    read_health,
)

NOT_SUPPORTED, GPU_IS_LOST, TIMEOUT, UNKNOWN = 3, 15, 10, 999


class StubError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class EventData:
    device: int
    eventType: int
    eventData: int


@dataclass
class FitLib:
    """The pynvml calls the fitness read makes; `fail[name] = code` makes one call fail."""

    gpus: int = 2
    recovery: int = 0
    field_return: int = 0
    rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    ecc_mode: tuple[int, int] = (1, 1)
    ecc: int = 0
    fail: dict[str, int] = field(default_factory=dict)
    supported_events: int = 65439  # what an H200 on driver 580 reports
    queued: list[EventData] = field(default_factory=list)
    registered: list[tuple[int, int]] = field(default_factory=list)
    freed: int = 0
    NVMLError = StubError
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def _check(self, name: str) -> None:
        if name in self.fail:
            raise StubError(self.fail[name])

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self._check(f"handle{i}")
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h:08x}"

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[int]) -> Any:
        # The real return: a ctypes array of c_nvmlFieldValue_t, each with its own nvmlReturn.
        self._check("fields")
        arr = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for i, fid in enumerate(ids):
            arr[i].fieldId = fid
            arr[i].nvmlReturn = self.field_return
            arr[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            arr[i].value.uiVal = self.recovery
        return arr

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        self._check("rows")
        return self.rows

    def nvmlDeviceGetEccMode(self, h: int) -> tuple[int, int]:
        self._check("ecc_mode")
        return self.ecc_mode

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        self._check("ecc")
        assert (kind, counter) == (1, 0)
        return self.ecc

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceGetSupportedEventTypes(self, h: int) -> int:
        self._check(f"events{h}")
        return self.supported_events

    def nvmlDeviceRegisterEvents(self, h: int, mask: int, s: str) -> None:
        self.registered.append((h, mask))

    def nvmlEventSetWait_v2(self, s: str, ms: int) -> EventData:
        if self.queued:
            return self.queued.pop(0)
        time.sleep(ms / 1000)
        raise StubError(TIMEOUT)

    def nvmlEventSetFree(self, s: str) -> None:
        self.freed += 1


def test_the_field_array_is_indexed_and_every_field_read() -> None:
    lib = FitLib(recovery=1, rows=(3, 1, 1, 0), ecc=2)
    r = read_health(lib, 0, "unknown")
    assert r == fitness.HealthRead(
        0,
        "GPU-00000000",
        lost=False,
        recovery_action=1,
        remapped_correctable=3,
        remapped_uncorrectable=1,
        remapped_pending=True,
        remapped_failure=False,
        ecc_uncorrected_volatile=2,
    )


def test_a_healthy_gpu_as_the_h200_answered() -> None:
    assert fitness.assess(read_health(FitLib(), 0, "")).ok


@pytest.mark.parametrize(
    ("lib", "field_name"),
    [
        (FitLib(field_return=NOT_SUPPORTED), "recovery_action"),
        (FitLib(fail={"fields": 13}), "recovery_action"),  # function not found: old driver
        (FitLib(fail={"rows": NOT_SUPPORTED}), "remapped_pending"),
        (FitLib(fail={"ecc_mode": NOT_SUPPORTED}), "ecc_uncorrected_volatile"),
        (FitLib(ecc_mode=(0, 0), ecc=5), "ecc_uncorrected_volatile"),  # ECC off
    ],
)
def test_not_supported_per_field(lib: FitLib, field_name: str) -> None:
    r = read_health(lib, 0, "")
    assert getattr(r, field_name) is fitness.NOT_SUPPORTED
    assert not r.lost
    f = fitness.assess(r)
    assert f.ok and field_name in f.not_supported


@pytest.mark.parametrize(
    "lib",
    [
        FitLib(field_return=GPU_IS_LOST),
        FitLib(fail={"rows": GPU_IS_LOST}),
        FitLib(fail={"handle1": GPU_IS_LOST}),
    ],
)
def test_lost_is_an_answer_with_the_last_known_uuid(lib: FitLib) -> None:
    nv = PynvmlNvml(lib)
    nv._uuids[1] = "GPU-known"
    reads = nv.health()
    lost = [r for r in reads if r.lost]
    assert lost and fitness.assess(lost[0]).action is fitness.Action.REBOOT
    if "handle1" in lib.fail:
        assert lost[0].uuid == "GPU-known"


def test_any_other_error_is_nvml_unavailable_not_healthy() -> None:
    with pytest.raises(NvmlUnavailable):
        PynvmlNvml(FitLib(fail={"ecc": UNKNOWN})).health()
    with pytest.raises(NvmlUnavailable):
        PynvmlNvml(FitLib(field_return=UNKNOWN)).health()


def test_event_set_registers_the_supported_critical_types() -> None:
    lib = FitLib(fail={"events1": NOT_SUPPORTED})
    ev = PynvmlEvents(lib, {})
    assert lib.registered == [(0, EVENT_MASK & 65439)]
    assert EVENT_MASK & 65439 == 32779  # the mask seen registering on an H200
    assert 1 in ev.unsupported and ev.registered == {0: 32779}


def test_event_wait_times_out_to_nothing_and_delivers_an_xid() -> None:
    lib = FitLib()
    ev = PynvmlEvents(lib, {})
    t = time.monotonic()
    assert ev.wait(50) == []
    assert time.monotonic() - t >= 0.05
    lib.queued.append(EventData(device=1, eventType=EVENT_XID, eventData=79))
    (got,) = ev.wait(50)
    assert (got.index, got.uuid, got.kind, got.xid) == (1, "GPU-00000001", "xid", 79)


def test_close_waits_for_a_wait_in_progress_and_frees_once() -> None:
    lib = FitLib()
    ev = PynvmlEvents(lib, {})
    t = threading.Thread(target=ev.wait, args=(200,))
    t.start()
    time.sleep(0.02)
    start = time.monotonic()
    ev.close()
    assert time.monotonic() - start > 0.1  # it waited for the wait to return
    ev.close()
    t.join()
    assert lib.freed == 1
    assert ev.wait(10) == []  # closed: no call into a freed set


def test_ctypes_array_is_not_a_list() -> None:
    # The reason read_health indexes the array: it has no list methods.
    arr = FitLib().nvmlDeviceGetFieldValues(0, [230])
    assert isinstance(arr, ctypes.Array) and not isinstance(arr, list)
