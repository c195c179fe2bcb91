"""GPU hygiene: find the processes on our GPUs, remove our leftovers, wait until memory is free.

Two layers over NVML (`supervisor.gpu.nvml`, which says what is on each GPU), in the order a reader
meets them, each in its own module; this one is the import surface and re-exports their names:

- `classify()` (`supervisor.gpu.classify`): pure. From NVML's view, each process's psutil facts
  and what this daemon launched it decides what every process on our GPUs is. Only our own
  leftovers are ever signalled.
- `clean()` (`supervisor.gpu.clean`): the effects. SIGTERM, grace, SIGKILL, each signal preceded
  by a (pid, create time) check; then wait until NVML shows the memory free, because the driver
  releases it asynchronously and a launch before that fails with out-of-memory ten minutes later
  (sglang PR #39545 waits the same way).

Beside them: the launch-record sweep, counted, and /status.leftovers (`supervisor.gpu.sweep`);
`kimi-serve gpu-clean` (`supervisor.gpu.cli`).

Why leftovers exist at all: an SGLang scheduler still loading when its parent dies has not yet
set PR_SET_PDEATHSIG and keeps its GPU memory (sglang #23627).
"""

from __future__ import annotations

from supervisor.gpu.classify import Classified as Classified
from supervisor.gpu.classify import Kind as Kind
from supervisor.gpu.classify import ProcFacts as ProcFacts
from supervisor.gpu.classify import classify as classify
from supervisor.gpu.clean import NVML_CALL_TIMEOUT as NVML_CALL_TIMEOUT
from supervisor.gpu.clean import CleanReport as CleanReport
from supervisor.gpu.clean import clean as clean
from supervisor.gpu.clean import gather_facts as gather_facts
from supervisor.gpu.cli import run_gpu_clean as run_gpu_clean
from supervisor.gpu.sweep import SweepReport as SweepReport
from supervisor.gpu.sweep import SweptProcess as SweptProcess
from supervisor.gpu.sweep import leftover_status as leftover_status
from supervisor.gpu.sweep import sweep_leftovers as sweep_leftovers
from supervisor.process.identity import owner_marker as owner_marker
