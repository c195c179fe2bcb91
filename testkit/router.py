"""The real routers (the PyPI wheels) as processes on loopback, for tests and benchmarks:
sglang-router 0.3.2 and its successor SMG (`smg` 1.13), docs/fleet.md.

Each starts with no workers; kimi-serve registers them through the worker API both share.
Started in its own session so a test can kill exactly the processes it started.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from supervisor.config import RouterConfig
from supervisor.metrics import Metrics
from supervisor.router import RouterLink
from testkit.standin import Standin
from testkit.wait import free_port

START_DEADLINE = 30.0

# Both wheels install a `smg` script (0.3.2's starts sglang-router): each is started by its
# Python module instead.
LEGACY, SMG = "sglang-router", "smg"
ROUTERS = (LEGACY, SMG)
MODULES = {LEGACY: ["sglang_router.launch_router"], SMG: ["smg", "launch"]}

# SMG's own checks, as docs/fleet.md chooses them for a kimi-serve fleet: its add job polls a
# new worker's /health every second (not every 30 s), a pending addition gives up after 20 s,
# and its periodic /health check (a backup to kimi-serve's liveness probe) runs every 10 s.
SMG_FLEET_FLAGS = [
    "--worker-startup-check-interval", "1",
    "--worker-startup-timeout-secs", "20",
    "--health-check-interval-secs", "10",
    "--health-check-timeout-secs", "5",
    "--health-failure-threshold", "3",
    "--health-success-threshold", "2",
]  # fmt: skip


def router_available(kind: str = LEGACY) -> bool:
    return importlib.util.find_spec(MODULES[kind][0].split(".")[0]) is not None


def routed(entry: Mapping[str, Any]) -> bool:
    """An entry the router may send requests to: SMG lists an entry it is adding (`pending`)
    or removing (`draining`) too, and routes nothing to it."""
    return entry.get("status") not in ("pending", "draining")


class RouterProcess:
    """`python -m sglang_router.launch_router` or `python -m smg launch`, `--host 127.0.0.1
    --port P`, and its log."""

    def __init__(
        self, extra: Sequence[str] = (), port: int | None = None, kind: str = LEGACY
    ) -> None:
        self.kind = kind
        self.port = port or free_port()
        self.metrics_port = free_port()  # its Prometheus exporter defaults to 29000: shared
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"{kind}-", suffix=".log")[1])
        self.start_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RouterProcess:
        argv = [
            sys.executable, "-m", *MODULES[self.kind],
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--log-level", "warn",
            *self.extra,
        ]  # fmt: skip
        began = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = began + START_DEADLINE
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.kind} exited at start: {self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/workers", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.kind} did not answer: {self.log_tail()}")
            time.sleep(0.05)
        self.start_seconds = time.monotonic() - began
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def workers(self) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/workers", timeout=5.0)
        r.raise_for_status()
        doc = r.json()
        return list(doc["workers"])

    def urls(self) -> list[str]:
        """The URLs it routes to (SMG's `pending` and `draining` entries left out)."""
        return [w["url"] for w in self.workers() if routed(w)]

    def cleanup(self) -> None:
        self.kill()
        with contextlib.suppress(OSError):
            self.log_path.unlink()


GENERATE = {"text": "Say hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


class Recorder:
    """A structlog-shaped logger that keeps what it was told."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))

    def errors(self) -> list[str]:
        return [str(kw.get("error")) for e, kw in self.lines if e == "router call failed"]


def served(standin: Standin) -> int:
    return standin.count('"POST /generate')


def make_link(
    client: httpx.AsyncClient,
    router_url: str,
    worker_url: str,
    drain_timeout: float = 5.0,
    **kw: Any,
) -> tuple[RouterLink, Recorder, Metrics]:
    cfg = RouterConfig(url=router_url, worker_url=worker_url, drain_timeout=drain_timeout)
    log = Recorder()
    metrics = Metrics(CollectorRegistry())
    opts: dict[str, Any] = {
        "request_timeout": 2.0,
        "confirm_timeout": 3.0,
        "recheck_interval": 0.2,
        "backoff_initial": 0.05,
        "backoff_max": 0.3,
        "poll_interval": 0.05,
    }
    opts.update(kw)
    return RouterLink(cfg, client, log, metrics, **opts), log, metrics
