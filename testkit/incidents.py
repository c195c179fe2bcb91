"""Incidents for tests: the stand-in's decode hang (and the restart-time bench's measure of it),
a sample `incident()` with its scheduler traceback and py-spy text, `cfg(path)` for the store,
a `Clock` a minute apart per call, and `pid_alive`/`kill_quietly` for the hung processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.config import IncidentsConfig
from supervisor.incidents import (
    Incident,
)
from supervisor.incidents.stacks import Capture, ProcessStack
from testkit.daemon import DaemonProcess, base_config, log_time

HANG = {"STANDIN_FAULT": "decode-hang", "STANDIN_FAULT_LAUNCH": "1"}


def hang_config(tmp: Path, dump_timeout: str = "10s") -> dict[str, Any]:
    cfg = base_config(tmp, incidents={"dump_timeout": dump_timeout})
    cfg["sglang"]["env"].update(HANG)
    return cfg


def restart_seconds(d: DaemonProcess) -> float:
    """From the daemon's decision to restart (`restarting`) to the launch gone (`cleaning`)."""
    begin = d.wait_state("restarting", 30)
    end = d.wait_state("cleaning", 30)
    return log_time(end) - log_time(begin)


TRACEBACK = [
    "[2026-12-01 03:12:09 TP0] Scheduler hit an exception: Traceback (most recent call last):",
    '  File "/sgl/scheduler.py", line 2961, in run_scheduler_process',
    "    scheduler.event_loop_overlap()",
    "AttributeError: 'EAGLEWorkerV2' object has no attribute 'spec_disable_batch_threshold'",
]


STACK_TEXT = textwrap.dedent(
    """\
    Process 4242: sglang::scheduler_TP0
    Python v3.11.7 (/usr/bin/python3.11)

    Thread 4242 (active): "MainThread"
        cuModuleLoadData (libcuda.so.1)
        verify (sglang/srt/speculative/eagle_worker_v2.py:512)
        event_loop_overlap (sglang/srt/managers/scheduler.py:1001)
    """
)


def cfg(path: Path, **kw: int) -> IncidentsConfig:
    base = {"keep": 20, "dump_timeout": 10, "max_bytes": 256 * 2**20, "min_free_bytes": 0}
    base.update(kw)
    return IncidentsConfig(
        dir=str(path),
        keep=base["keep"],
        dump_timeout=float(base["dump_timeout"]),
        max_bytes=base["max_bytes"],
        min_free_bytes=base["min_free_bytes"],
    )


class Clock:
    def __init__(self, start: float = 1_795_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 61.0
        return self.now


def incident(
    launch: int = 3, reason: str = "liveness_failed", stacks: str = STACK_TEXT
) -> Incident:
    cap = Capture(
        stacks=(ProcessStack(4242, "sglang::scheduler_TP0", stacks, None, True, 0.4),),
        seconds=0.41,
        py_spy="/usr/bin/py-spy",
    )
    return Incident(
        reason=reason,
        detail="3 consecutive liveness probes failed (timeout)",
        launch=launch,
        profile="primary",
        signal=9,
        timings={"launched_at": 1_794_999_000.0, "ready_at": 1_794_999_600.0},
        config_path="/etc/kimi-serve/kimi-serve.yaml",
        config_digest="sha256:abc",
        server_info={"version": "0.5.23", "speculative_algorithm": "EAGLE3", "tp_size": 8},
        gpus=[{"index": 0, "uuid": "GPU-1", "memory_used_bytes": 1, "processes": []}],
        log_tail=TRACEBACK,
        capture=cap,
    )


Spawn = Callable[[], subprocess.Popen[str]]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); its state says it is gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
