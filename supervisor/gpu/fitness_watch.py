"""GPU fitness, the effects: read it before a launch, watch NVML's critical events while serving.

The verdicts are `supervisor.gpu.fitness`'s (pure); this module only reads NVML through the one
thread adapter (`threads.in_thread`: NVML blocks in the driver, and a hung GPU must not stall
the loop), keeps the last event per GPU, updates the metrics, and turns what it saw into the
machine's events (`GpuUnfit` before a launch, `GpuFault` while serving). The machine decides.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from supervisor.core.machine import GpuFault, GpuUnfit
from supervisor.gpu import fitness
from supervisor.gpu.fitness import FitnessReport, XidEvent
from supervisor.gpu.nvml import EventSource, HealthSource, NvmlUnavailable
from supervisor.threads import in_thread

# An NVML call that takes longer than this means a hung driver or GPU (as in gpu/clean.py).
NVML_CALL_TIMEOUT = 10.0
# nvmlEventSetWait blocks for its whole timeout when nothing happens (2.002 s for 2000 ms on
# an H200): one slice is how late a stop or cancellation can be noticed.
EVENT_SLICE_S = 1.0
# While serving, fitness is also read again this often: a recovery action, a pending remap or a
# volatile ECC count can change with no critical event of its own (and a GPU that is fit again
# reads so in /status and the metrics without waiting for one).
HEALTH_POLL_S = 5.0


async def read(
    source: HealthSource, devices: str | tuple[int | str, ...]
) -> list[fitness.HealthRead]:
    """The managed GPUs' fitness fields. Raises NvmlUnavailable (a hung driver included)."""
    try:
        reads = await in_thread(source.health, NVML_CALL_TIMEOUT)
    except TimeoutError:
        raise NvmlUnavailable(
            f"NVML did not answer within {NVML_CALL_TIMEOUT:g}s reading GPU health: the driver "
            "or a GPU is hung (nvidia-smi will hang too); the host needs attention"
        ) from None
    return fitness.select_reads(reads, devices)


@dataclass
class Monitor:
    """Fitness state of the managed GPUs, for /status, the metrics and the machine.

    `gauge(index, uuid, healthy)` and `count_xid(index, uuid, xid)` are the metric effects
    (`Metrics.gpu_healthy` / `Metrics.gpu_xid_events`); `post` queues a machine event.
    """

    source: HealthSource
    devices: str | tuple[int | str, ...]
    post: Callable[[Any], None]
    gauge: Callable[[int, str, bool], None] = lambda _i, _u, _h: None
    count_xid: Callable[[int, str, int], None] = lambda _i, _u, _x: None
    log: Callable[..., None] = lambda *_a, **_k: None
    last: FitnessReport | None = None
    last_xids: dict[str, XidEvent] = field(default_factory=dict)  # by UUID

    def _managed(self, event: XidEvent) -> bool:
        if self.devices == "all":
            return True
        return any(
            (isinstance(d, int) and d == event.index)
            or (isinstance(d, str) and d.lower() == event.uuid.lower())
            for d in self.devices
        )

    async def assess(self) -> FitnessReport:
        """Read and judge every managed GPU; metrics updated. Raises NvmlUnavailable."""
        report = fitness.assess_all(await read(self.source, self.devices), self.last_xids)
        self.last = report
        for f in report.gpus:
            self.gauge(f.index, f.uuid, f.ok)
        return report

    async def before_launch(self) -> GpuUnfit | None:
        """The check before every launch: None when every managed GPU is fit, else the event
        to post (the machine goes `failed` with its line and does not relaunch)."""
        try:
            report = await self.assess()
        except NvmlUnavailable as exc:
            return GpuUnfit(f"cannot read GPU health: {exc}")
        if report.ok:
            return None
        self.log("gpu unfit", line=report.line(), action=report.action.value)
        return GpuUnfit(report.line())

    def health_by_index(self) -> dict[int, dict[str, Any]]:
        """/status.gpus[].health, keyed by NVML index (merge into nvml.gpu_status())."""
        if self.last is None:
            return {}
        return {f.index: f.health() for f in self.last.gpus}

    async def on_event(self, event: XidEvent) -> None:
        """One critical event: counted and reported at once; then fitness is read again and
        the machine told (`GpuFault`, restart only where a GPU is lost or the driver asks)."""
        if not self._managed(event):
            return
        if event.kind == "xid":
            self.last_xids[event.uuid] = event
            self.count_xid(event.index, event.uuid, event.xid)
        try:
            report = await self.assess()
        except NvmlUnavailable as exc:
            self._fault(f"GPU {event.index} ({event.uuid}): {event.describe()}; {exc}", True)
            return
        bad = report.unfit
        if event.kind == "ecc_single_bit" and not bad:
            # A corrected error: the memory did its job. Only its consequences are news.
            return
        what = f"GPU {event.index} ({event.uuid}): {event.describe()}"
        line = report.line() if bad else f"{what}; the driver asks for no action"
        if bad and event.uuid not in {f.uuid for f in bad}:
            line = f"{what}; {line}"
        self._fault(line, report.restart_needed)

    def _fault(self, line: str, restart: bool) -> None:
        """Logged and told to the machine, which decides what a restart means now."""
        self.log("gpu fault", line=line, restart=restart)
        self.post(GpuFault(line, restart=restart))

    async def recheck(self) -> None:
        """Fitness read again with no event: a GPU newly unfit (or needing another action) is
        reported at once, as an event would have been; one that is unfit as before is not
        reported again. A read that fails is left to the event wait, which reports a hung
        driver."""
        before = _unfit_key(self.last)
        try:
            report = await self.assess()
        except NvmlUnavailable:
            return
        after = _unfit_key(report)
        if after - before:
            self._fault(report.line(), report.restart_needed)
        elif before and not after:
            self.log("gpu fit again", line=report.line())

    async def watch(
        self,
        events: EventSource,
        slice_s: float = EVENT_SLICE_S,
        poll_s: float = HEALTH_POLL_S,
    ) -> None:
        """The Xid watcher task: runs until cancelled; closes the event set on the way out.

        Each wait is one slice in the thread adapter, never on the loop. A wait that does not
        come back within the slice plus NVML_CALL_TIMEOUT means a hung driver: reported as a
        fault of every managed GPU, and watching goes on. Every `poll_s` fitness is read
        again (`recheck`).
        """
        ms = max(1, int(slice_s * 1000))
        loop = asyncio.get_running_loop()
        next_poll = loop.time() + poll_s
        try:
            while True:
                if loop.time() >= next_poll:
                    await self.recheck()
                    next_poll = loop.time() + poll_s
                try:
                    got = await in_thread(lambda: events.wait(ms), slice_s + NVML_CALL_TIMEOUT)
                except TimeoutError:
                    self.post(
                        GpuFault(
                            f"NVML's event wait did not return within "
                            f"{slice_s + NVML_CALL_TIMEOUT:g}s: the driver or a GPU is hung",
                            restart=False,
                        )
                    )
                    continue
                except NvmlUnavailable as exc:
                    self.post(GpuFault(f"NVML event wait failed: {exc}", restart=False))
                    await asyncio.sleep(slice_s)
                    continue
                for event in got:
                    await self.on_event(event)
        finally:
            # close() waits for a wait in progress (at most one slice): never on the loop.
            with contextlib.suppress(TimeoutError, NvmlUnavailable):
                await asyncio.shield(in_thread(events.close, slice_s + NVML_CALL_TIMEOUT))


def _unfit_key(report: FitnessReport | None) -> frozenset[tuple[str, fitness.Action]]:
    """What a report finds wrong: the unfit GPUs by UUID, with the action each needs."""
    if report is None:
        return frozenset()
    return frozenset((f.uuid, f.action) for f in report.unfit)


def health_source(nvml: object) -> HealthSource | None:
    """The opened NVML as a fitness source, or None for one that cannot read fitness."""
    if callable(getattr(nvml, "health", None)) and callable(getattr(nvml, "open_events", None)):
        return nvml  # type: ignore[return-value]
    return None


async def open_events(source: HealthSource) -> EventSource:
    """NVML's critical-event set, opened in the thread adapter. Raises NvmlUnavailable."""
    try:
        return await in_thread(source.open_events, NVML_CALL_TIMEOUT)
    except TimeoutError:
        raise NvmlUnavailable(
            f"NVML did not open its event set within {NVML_CALL_TIMEOUT:g}s"
        ) from None


async def start(
    nvml: object,
    devices: Any,
    emit: Callable[[Any], None],
    metrics: Any,
    log: Any,
    spawn: Callable[[Any], object],
) -> Monitor | None:
    """The daemon's fitness monitor of the managed GPUs and its Xid watcher task (docs/gpu.md);
    None where NVML gives no health source (gpus.manage off)."""
    source = health_source(nvml)
    if source is None:
        return None
    monitor = Monitor(
        source,
        devices,
        emit,
        gauge=metrics.set_gpu_healthy,
        count_xid=metrics.count_xid,
        log=log.warning,
    )
    try:
        events = await open_events(source)
    except NvmlUnavailable as exc:
        log.warning("no Xid watcher: NVML's event set cannot be opened", error=str(exc))
        return monitor
    spawn(monitor.watch(events))
    return monitor
