"""Both sides of the conformance suite: the SGLang stand-in and real SGLang 0.5.23 on this CPU,
started alike (`start(side, sgl, log_path, fault=...)`), each a `Server` the comparisons ask
the same things of. A fault is named once for both sides (`SCHEDULER_EXCEPTION`): the
stand-in's STANDIN_FAULT=seed-incident, or real SGLang's scheduler made to raise by the
test-only hook (tests/realsglang/faulthook, KIMI_TEST_FAULT=decode-attributeerror)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

from testkit import realsglang as real
from testkit.wait import free_port

SIDES = ("standin", "real")
READY_LINE = real.READY_LINE
SCHEDULER_EXCEPTION = "scheduler-exception"
_FAULT_ENV = {
    "standin": {SCHEDULER_EXCEPTION: {"STANDIN_FAULT": "seed-incident"}},
    "real": {SCHEDULER_EXCEPTION: {"KIMI_TEST_FAULT": "decode-attributeerror"}},
}
# Slow enough that a long generation can be watched while it runs, as on the real server
# (about 250 tokens/s on two cores).
_STANDIN_ENV = {
    "STANDIN_LOAD_SECONDS": "0.5",
    "STANDIN_WARMUP_SECONDS": "0.2",
    "STANDIN_DECODE_SECONDS_PER_TOKEN": "0.004",
}


@dataclasses.dataclass
class Server(real.RealServer):
    """One running server of either side, started in its own session, logging to a file (the
    real server's handle: url, pid, log, stop), plus what the comparisons ask of it."""

    side: str = "real"

    def wait_log(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern, re.M)
        while not (m := rx.search(self.log())):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"[{self.side}] {pattern!r} not logged in {timeout:g} s:\n{self.log()[-3000:]}"
                )
            time.sleep(0.05)
        return m

    def get(self, path: str, timeout: float = 30.0) -> httpx.Response:
        return httpx.get(self.url + path, timeout=timeout)

    def post(self, path: str, body: Any, timeout: float = 60.0) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def generate(self, n: int, timeout: float = 60.0) -> httpx.Response:
        return self.post(
            "/generate",
            {"text": "Hello world", "sampling_params": {"max_new_tokens": n, "temperature": 0}},
            timeout,
        )

    def group(self) -> list[psutil.Process]:
        """Every live process of the launch's process group except the main process."""
        out = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                ours = proc.pid != self.pid and os.getpgid(proc.pid) == self.pid
                if ours and proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(proc)
        return out

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"[{self.side}] still running after {timeout:g} s:\n{self.log()[-3000:]}"
            ) from None


Launch = Callable[..., Server]


def _argv(side: str, sgl: real.SGLangEnv, port: int) -> list[str]:
    if side == "real":
        return real.server_argv(sgl, port)
    return real.server_argv(sgl, port, python=sys.executable, module="supervisor.standin")


def _env(side: str, fault: str | None, extra: Mapping[str, str]) -> dict[str, str]:
    faults = _FAULT_ENV[side][fault] if fault else {}
    if side == "real":
        return real.server_env({**faults, **extra})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STANDIN_", "KIMI_TEST_"))}
    return {**env, **_STANDIN_ENV, **faults, **extra}


def start(
    side: str,
    sgl: real.SGLangEnv,
    log_path: Path,
    *,
    fault: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Server:
    port = free_port()
    return real.spawn(
        _argv(side, sgl, port),
        _env(side, fault, env or {}),
        log_path,
        port,
        real.START_TIMEOUT,
        lambda proc: Server(proc, port, log_path, side=side),
    )


def titled(procs: Sequence[psutil.Process]) -> dict[str, psutil.Process]:
    """The group's processes by the title setproctitle gave them (`sglang::...`)."""
    out = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            cmdline = proc.cmdline()
            if cmdline and cmdline[0].startswith("sglang::"):
                out[cmdline[0]] = proc
    return out
