"""The real sglang-router (the PyPI wheel) as a process on loopback, for tests and benchmarks.

It starts with no workers; kimi-serve registers them through its worker API. Started in its
own session so a test can kill exactly the processes it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
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


def router_available() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True


class RouterProcess:
    """`python -m sglang_router.launch_router --host 127.0.0.1 --port P` and its log."""

    def __init__(self, extra: Sequence[str] = (), port: int | None = None) -> None:
        self.port = port or free_port()
        self.metrics_port = free_port()  # its Prometheus exporter defaults to 29000: shared
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="sglang-router-", suffix=".log")[1])
        self.start_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RouterProcess:
        argv = [
            sys.executable, "-m", "sglang_router.launch_router",
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
                raise AssertionError(f"sglang-router exited at start: {self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/workers", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"sglang-router did not answer: {self.log_tail()}")
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
        return [w["url"] for w in self.workers()]

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
