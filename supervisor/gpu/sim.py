"""A simulated NVML, for tests and `kimi-serve demo` on machines with no GPU. Not a driver model.

It answers the one question cleaning asks, "which processes hold memory on which GPU", from the
live process table, so everything around it (processes, signals, identity checks) stays real:

- `KIMI_SERVE_SIMULATED_GPUS=N`: N GPUs, indexes 0..N-1, with fixed fake UUIDs.
- A process holds `KIMI_SERVE_SIMULATED_GPU_MIB` (default 4096) MiB on GPU i when its command
  line's first or last argument is `sglang::scheduler_TP<i>` (`sglang::scheduler`: GPU 0), as
  SGLang's process titles read (first: after setproctitle; last: the stand-in's children before
  it), or it carries `--sim-gpu i` (repeatable).
- `KIMI_SERVE_SIM_TAG` (required): only processes whose environment carries the same tag are
  seen, so tests and demos running side by side on one machine never see (or clean) each
  other's processes; whatever the daemon launches inherits the tag from its environment. A
  titled scheduler's environment reads empty (setproctitle reuses its memory unless
  SPT_NOENV=1): its parent's environment is asked instead.
- A dead process frees its memory; so does a zombie, as measured on an H200 (docs/sglang.md,
  "GPU memory").
- `KIMI_SERVE_SIMULATED_WEDGED_MIB`: memory held with no process, as a wedged GPU shows it:
  `2048` (on GPU 0) or `1:2048,3:512` (per GPU).
- `KIMI_SERVE_SIMULATED_GPU_HEALTH`: fitness faults, `GPU:CONDITION` pairs, comma-separated:
  `lost`, `recovery=N` (nvmlGpuRecoveryAction_t: 1 reset, 2 node reboot, ...),
  `remap_pending`, `remap_failure`, `ecc=N` (volatile uncorrectable errors) and
  `unsupported` (every field "not supported", as on a GPU without ECC or an old driver).
  `@FILE` instead reads the same text from FILE at every read, so a test can break a GPU
  while SGLang serves. A lost GPU also makes the process snapshot fail, as NVML does.
- `KIMI_SERVE_SIMULATED_XID_FILE`: a file a test appends `GPU:XID` lines to; each new line is
  one critical Xid event delivered by the event set.
"""

from __future__ import annotations

import itertools
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from supervisor.gpu import fitness
from supervisor.gpu.nvml import (
    GpuProcess,
    GpuSnapshot,
    MiB,
    Nvml,
    NvmlUnavailable,
    PynvmlNvml,
    event_kind,
)

ENV_GPUS = "KIMI_SERVE_SIMULATED_GPUS"
ENV_MIB = "KIMI_SERVE_SIMULATED_GPU_MIB"
ENV_WEDGED = "KIMI_SERVE_SIMULATED_WEDGED_MIB"
ENV_TAG = "KIMI_SERVE_SIM_TAG"
ENV_HEALTH = "KIMI_SERVE_SIMULATED_GPU_HEALTH"
ENV_XID_FILE = "KIMI_SERVE_SIMULATED_XID_FILE"
CONDITIONS = ("lost", "recovery", "remap_pending", "remap_failure", "ecc", "unsupported")
TOTAL_MIB = 143771  # an H200 as nvidia-smi shows it
_SCHEDULER = re.compile(r"sglang::scheduler(?:_TP(\d+))?")


def simulated_uuid(index: int) -> str:
    return f"GPU-51a11a7e-0000-4000-8000-{index:012d}"


def gpus_of(cmdline: Sequence[str]) -> set[int]:
    """The simulated GPUs a command line claims memory on."""
    out = set()
    for arg in {cmdline[0], cmdline[-1]} if cmdline else ():
        if m := _SCHEDULER.fullmatch(arg):
            out.add(int(m.group(1) or 0))
    for flag, value in itertools.pairwise(cmdline):
        if flag == "--sim-gpu" and value.isdigit():
            out.add(int(value))
    return out


def _wedged(text: str, gpus: int) -> dict[int, int]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        index, _, mib = part.rpartition(":")
        if not mib.isdigit() or (index and not index.isdigit()) or int(index or 0) >= gpus:
            raise NvmlUnavailable(
                f"{ENV_WEDGED}={text!r}: expected MiB (on GPU 0) or GPU:MiB pairs such as "
                f"1:2048,3:512 for GPUs 0-{gpus - 1}"
            )
        out[int(index or 0)] = int(mib)
    return out


def _count(env: Mapping[str, str], name: str, default: str, low: int) -> int:
    text = env.get(name, default)
    if not text.isdigit() or int(text) < low:
        raise NvmlUnavailable(f"{name}={text!r} must be a whole number >= {low}")
    return int(text)


def parse_health(text: str, gpus: int) -> dict[int, dict[str, int]]:
    """`1:lost,2:recovery=2,3:ecc=4` -> {1: {"lost": 1}, 2: {"recovery": 2}, 3: {"ecc": 4}}."""
    out: dict[int, dict[str, int]] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        index, _, cond = part.partition(":")
        name, _, value = cond.partition("=")
        ok = (
            index.isdigit()
            and int(index) < gpus
            and name in CONDITIONS
            and ((name in ("recovery", "ecc")) == value.isdigit())
        )
        if not ok:
            raise NvmlUnavailable(
                f"{ENV_HEALTH}: {part!r}: expected GPU:CONDITION with GPU 0-{gpus - 1} and "
                "CONDITION one of lost, recovery=N, remap_pending, remap_failure, ecc=N, "
                "unsupported"
            )
        out.setdefault(int(index), {})[name] = int(value or 1)
    return out


class SimulatedEvents:
    """Critical events from a file of `GPU:XID` lines (each line read once)."""

    def __init__(self, path: str | None, gpus: int) -> None:
        self.path = Path(path) if path else None
        self.gpus = gpus
        self._offset = self.path.stat().st_size if self.path and self.path.exists() else 0
        self._lock = threading.Lock()
        self._closed = False

    def _new(self) -> list[fitness.XidEvent]:
        if self.path is None or not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        out = []
        for line in data[:end].decode().split():
            index, _, xid = line.partition(":")
            if index.isdigit() and xid.isdigit() and int(index) < self.gpus:
                i = int(index)
                out.append(
                    fitness.XidEvent(i, simulated_uuid(i), event_kind(0x8), int(xid), time.time())
                )
        return out

    def wait(self, timeout_ms: int) -> list[fitness.XidEvent]:
        deadline = time.monotonic() + timeout_ms / 1000
        with self._lock:
            while not self._closed:
                events = self._new()
                if events or time.monotonic() >= deadline:
                    return events
                time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
        return []

    def close(self) -> None:
        with self._lock:
            self._closed = True


@dataclass
class SimulatedNvml:
    gpus: int
    mib_per_process: int = 4096
    wedged_mib: dict[int, int] = field(default_factory=dict)
    tag: str = ""
    health_spec: str = ""  # ENV_HEALTH's value ("@FILE": read from FILE at every read)
    xid_file: str | None = None

    def _faults(self) -> dict[int, dict[str, int]]:
        text = self.health_spec
        if text.startswith("@"):
            try:
                text = Path(text[1:]).read_text()
            except FileNotFoundError:
                text = ""
        return parse_health(text.strip(), self.gpus)

    def health(self) -> list[fitness.HealthRead]:
        faults = self._faults()
        out = []
        for i in range(self.gpus):
            f = faults.get(i, {})
            uuid = simulated_uuid(i)
            if f.get("lost"):
                out.append(fitness.HealthRead(i, uuid, lost=True))
            elif f.get("unsupported"):
                out.append(fitness.HealthRead(i, uuid, lost=False))
            else:
                out.append(
                    fitness.HealthRead(
                        i,
                        uuid,
                        lost=False,
                        recovery_action=f.get("recovery", 0),
                        remapped_pending=bool(f.get("remap_pending")),
                        remapped_failure=bool(f.get("remap_failure")),
                        remapped_uncorrectable=0,
                        remapped_correctable=0,
                        ecc_uncorrected_volatile=f.get("ecc", 0),
                    )
                )
        return out

    def open_events(self) -> SimulatedEvents:
        return SimulatedEvents(self.xid_file, self.gpus)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SimulatedNvml:
        gpus = _count(env, ENV_GPUS, "0", 1)
        tag = env.get(ENV_TAG, "")
        if not tag:
            # Untagged, every stand-in on the machine would look like one of ours.
            raise NvmlUnavailable(
                f"{ENV_GPUS} is set but {ENV_TAG} is not: set it to a value unique to this "
                "daemon (its launches inherit it), so the simulation sees only their processes"
            )
        health = env.get(ENV_HEALTH, "")
        if not health.startswith("@"):
            parse_health(health, gpus)  # a misspelt condition fails now, not at the first read
        return cls(
            gpus=gpus,
            mib_per_process=_count(env, ENV_MIB, "4096", 0),
            wedged_mib=_wedged(env.get(ENV_WEDGED, ""), gpus),
            tag=tag,
            health_spec=health,
            xid_file=env.get(ENV_XID_FILE) or None,
        )

    def snapshot(self) -> list[GpuSnapshot]:
        lost = sorted(i for i, f in self._faults().items() if f.get("lost"))
        if lost:
            raise NvmlUnavailable(
                f"GPU {lost[0]}: the GPU is lost (fell off the bus, see dmesg for Xid 79); "
                "it needs a GPU reset or a reboot before anything can run on it"
            )
        health = self.health()
        held: dict[int, list[GpuProcess]] = {i: [] for i in range(self.gpus)}
        for proc in psutil.process_iter(["cmdline", "status"]):
            info = proc.info
            if info["status"] in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                continue
            gpus = {g for g in gpus_of(info["cmdline"] or ()) if g < self.gpus}
            if not gpus:
                continue
            try:
                env = proc.environ()
                if not env and (parent := proc.parent()) is not None:
                    env = parent.environ()
                if env.get(ENV_TAG) != self.tag:
                    continue
            except (psutil.Error, OSError):
                continue
            for g in gpus:
                held[g].append(GpuProcess(proc.pid, self.mib_per_process * MiB))
        return [
            GpuSnapshot(
                index=i,
                uuid=simulated_uuid(i),
                name="Simulated GPU",
                memory_used_bytes=sum(p.used_bytes or 0 for p in procs)
                + self.wedged_mib.get(i, 0) * MiB,
                memory_total_bytes=TOTAL_MIB * MiB,
                processes=tuple(sorted(procs, key=lambda p: p.pid)),
                health=health[i],
            )
            for i, procs in held.items()
        ]

    def close(self) -> None:
        """Nothing to release; present for the Nvml interface."""


def open_nvml(env: Mapping[str, str] | None = None) -> Nvml:
    """The host's NVML, or the simulation when KIMI_SERVE_SIMULATED_GPUS is set in `env`.

    The command line's choice (tests and `kimi-serve demo` set the variable); the production
    factory, `nvml.PynvmlNvml`, never looks at the environment. Raises NvmlUnavailable.
    """
    env = os.environ if env is None else env
    if env.get(ENV_GPUS):
        return SimulatedNvml.from_env(env)
    return PynvmlNvml()
