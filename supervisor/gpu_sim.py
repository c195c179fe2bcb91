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
- A dead process frees its memory; so does a zombie, as measured on an H200 (sglang-facts.md).
- `KIMI_SERVE_SIMULATED_WEDGED_MIB`: memory held with no process, as a wedged GPU shows it:
  `2048` (on GPU 0) or `1:2048,3:512` (per GPU).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import psutil

from supervisor.nvml import GpuProcess, GpuSnapshot, MiB, NvmlUnavailable

ENV_GPUS = "KIMI_SERVE_SIMULATED_GPUS"
ENV_MIB = "KIMI_SERVE_SIMULATED_GPU_MIB"
ENV_WEDGED = "KIMI_SERVE_SIMULATED_WEDGED_MIB"
ENV_TAG = "KIMI_SERVE_SIM_TAG"
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


@dataclass
class SimulatedNvml:
    gpus: int
    mib_per_process: int = 4096
    wedged_mib: dict[int, int] = field(default_factory=dict)
    tag: str = ""

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
        return cls(
            gpus=gpus,
            mib_per_process=_count(env, ENV_MIB, "4096", 0),
            wedged_mib=_wedged(env.get(ENV_WEDGED, ""), gpus),
            tag=tag,
        )

    def snapshot(self) -> list[GpuSnapshot]:
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
            )
            for i, procs in held.items()
        ]

    def close(self) -> None:
        """Nothing to release; present for the Nvml interface."""
