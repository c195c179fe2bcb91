"""The real `kimi-serve run` against the real SGLang 0.5.23 server on this CPU.

The server side (environment, tiny model, CPU flags, fault hook) is tests/realsglang/server.py
and tools/sglang-env; the daemon side is the project's test kit (testkit/), unchanged: the daemon's
JSON log lines on a queue, `wait_state()` blocking on them. Each launch of the real server
costs 20-60 s on two cores, so one daemon serves a whole module (`module_daemon`), and the
tests of a module run in file order against it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

import testkit
from testkit.daemon import _merge
from testkit.sglang_cpu import CPU_ARGS
from tests.realsglang import server as real

PROBE_TOKENS = 8
LOAD_TIMEOUT = 240.0  # launch -> ready on a busy 2-core machine took up to 80 s


def daemon_config(
    tmp: Path,
    sgl: real.SGLangEnv,
    *,
    args: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    **sections: Any,
) -> dict[str, Any]:
    cfg = testkit.base_config(tmp)
    cfg["sglang"] = {
        "python": sgl.python,
        "module": "sglang.launch_server",
        "model_path": sgl.model,
        "host": "127.0.0.1",
        "port": testkit.free_port(),
        "args": {**CPU_ARGS, **(args or {})},
        "env": {
            # What a real server needs on a CPU (server.server_env()).
            "SGLANG_USE_CPU_ENGINE": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join([str(real.STUB_DIR), str(real.FAULT_HOOK_DIR)]),
            # As the shipped config: environ stays readable, a scheduler exception kills the
            # whole group at once.
            "SPT_NOENV": "1",
            "SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION": "1",
            **(env or {}),
        },
    }
    cfg["profiles"] = {}
    _merge(
        cfg,
        {
            "readiness": {
                "load_timeout": f"{LOAD_TIMEOUT:g}s",
                "probe": {"max_tokens": PROBE_TOKENS, "timeout": "30s"},
            },
            # Production's shape at test speed. The timeout leaves room for an 8-token decode
            # on two cores shared with other jobs (load average above 10 at times: 2 s was
            # not enough there even at idle); a probe queued behind long generations still
            # times out, which is what the saturation tests need.
            "liveness": {"interval": "1s", "timeout": "5s", "failure_threshold": 3},
            "restart": {
                "backoff_initial": "0.2s",
                "backoff_max": "1s",
                "crash_loop": {"max_restarts": 20, "window": "1h"},
            },
            "stop": {"drain_timeout": "20s"},
        },
    )
    _merge(cfg, sections)
    return cfg


@pytest.fixture(scope="session")
def sgl() -> real.SGLangEnv:
    return real.build_env()


@pytest.fixture(scope="session")
def canary_sgl(sgl: real.SGLangEnv) -> real.SGLangEnv:
    """The real environment serving the confident canary model (tools/make-canary-model), built
    on first use: `daemon_config(tmp, canary_sgl, quality={"canary": {"prompt":
    real.CANARY_PROMPT}})`."""
    return real.canary_env(sgl)


@dataclass
class Real:
    """A running daemon with a real SGLang under it."""

    d: testkit.DaemonProcess
    tmp: Path

    @property
    def sglang_url(self) -> str:
        return f"http://127.0.0.1:{self.d.cfg['sglang']['port']}"

    def processes(self) -> dict[int, str]:
        """pid -> title (or command line) of every process of the current launch."""
        child = self.d.status()["child"]
        assert child, "no SGLang child"
        out = {}
        for pid in child["processes"]:
            with contextlib.suppress(psutil.Error):
                out[pid] = " ".join(psutil.Process(pid).cmdline())
        return out

    def pid_of(self, title: str) -> int:
        found = [p for p, cmd in self.processes().items() if cmd.startswith(title)]
        assert len(found) == 1, f"{title}: {self.processes()}"
        return found[0]

    def readyz(self, client: httpx.Client | None = None) -> int:
        return (client or httpx).get(self.d.admin + "/readyz", timeout=5).status_code

    def wait_ready(self, timeout: float = LOAD_TIMEOUT) -> dict[str, Any]:
        return self.d.wait_state("ready", timeout)

    def rewrite(self, change: Callable[[dict[str, Any]], None]) -> None:
        change(self.d.cfg)
        self.d.config_path.write_text(yaml.safe_dump(self.d.cfg))


@contextlib.contextmanager
def real_daemon(tmp: Path, cfg: dict[str, Any]) -> Iterator[Real]:
    with testkit.running(tmp, cfg) as d:
        yield Real(d, tmp)


def log_time(event: dict[str, Any]) -> float:
    """Unix time of one of the daemon's JSON log lines."""
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def generate(
    url: str, max_new_tokens: int, text: str = "Tell me a story.", timeout: float = 300.0
) -> dict[str, Any]:
    r = httpx.post(
        url + "/generate",
        json={
            "text": text,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        },
        timeout=timeout,
    )
    r.raise_for_status()
    doc: dict[str, Any] = r.json()
    return doc


def alive(pids: object) -> list[int]:
    assert isinstance(pids, (list, set, tuple, dict))
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


def until(pred: Callable[[], bool], timeout: float, what: str, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def report(name: str, value: float, unit: str = "s") -> None:
    """One measured figure, printed for docs/benchmarks.md (run with -s to see it)."""
    print(f"\n[realsglang] {name}: {value:.3f} {unit}")
