"""The real sglang-router (the PyPI wheel) as a process on loopback, for tests and benchmarks.

It starts with no workers; kimi-serve registers them through its worker API. Started in its
own session so a test can kill exactly the processes it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

START_DEADLINE = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
