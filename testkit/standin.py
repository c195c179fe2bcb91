"""Start the stand-in as a real process and watch it the way a supervisor would.

Synchronisation is on what the process shows: its stderr lines, its exit, its process tree,
its HTTP answers; every wait has a deadline and fails with the log tail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import psutil

from testkit.paths import REPO_ROOT
from testkit.procs import alive
from testkit.wait import free_port

READY_LINE = "The server is fired up and ready to roll!"
BOUND_LINE = "Uvicorn running on"
DEADLINE = 15.0
MODEL = "/models/kimi-k2.5-int4"

# Fast but otherwise default timings; a test overrides what it is about.
BASE_ENV = {
    "STANDIN_LOAD_SECONDS": "0.1",
    "STANDIN_WARMUP_SECONDS": "0.02",
    "STANDIN_CRASH_SLEEP_SECONDS": "0.3",
    "STANDIN_ORPHAN_LIFETIME": "60",
}


def gone(proc: psutil.Process) -> bool:
    """Exited (a zombie has exited too: nothing may reap an orphan here)."""
    return not alive(proc)


class Standin:
    def __init__(self, flags: Sequence[str], env: Mapping[str, str], port: int) -> None:
        self.port = port
        self.argv = [sys.executable, "-m", "supervisor.standin", *flags]
        full_env = {
            k: v for k, v in os.environ.items() if not k.startswith(("STANDIN_", "SGLANG_", "SGL_"))
        }
        full_env |= BASE_ENV | dict(env)
        self.lines: list[str] = []
        self.stdout = b""
        self._cond = threading.Condition()
        self._eof = False
        self.known_children: list[psutil.Process] = []
        # As the supervisor launches SGLang: its own session and process group.
        self.proc = subprocess.Popen(
            self.argv,
            cwd=REPO_ROOT,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._threads = [
            threading.Thread(target=self._read_stderr, daemon=True),
            threading.Thread(target=self._read_stdout, daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- logs -----------------------------------------------------------------------------

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            with self._cond:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        self.stdout = self.proc.stdout.read()

    def log_tail(self, n: int = 40) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def count(self, needle: str) -> int:
        with self._cond:
            return sum(needle in line for line in self.lines)

    def wait_line(self, needle: str, timeout: float = DEADLINE, times: int = 1) -> str:
        """The `times`-th line containing `needle`, once it has been printed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                hits = [line for line in self.lines if needle in line]
                if len(hits) >= times:
                    return hits[times - 1]
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    why = "stderr closed" if self._eof else f"{timeout:g} s passed"
                    raise AssertionError(
                        f"{needle!r} (x{times}) not printed ({why}); log tail:\n"
                        + "\n".join(self.lines[-40:])
                    )
                self._cond.wait(left)

    def wait_ready(self, timeout: float = DEADLINE) -> None:
        self.wait_line(READY_LINE, timeout)
        self.children()  # remember them for the cleanup

    def wait_exit(self, timeout: float = DEADLINE) -> int:
        """The exit status, once the process is gone and its pipes are read to the end
        (they stay open while an orphaned child still holds them: then don't wait for that).
        """
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running after {timeout:g} s; log tail:\n{self.log_tail()}"
            ) from None
        if not any(not gone(c) for c in self.known_children):
            for t in self._threads:
                t.join(timeout)
        return code

    # -- processes ------------------------------------------------------------------------

    def children(self) -> list[psutil.Process]:
        """The stand-in's scheduler and detokenizer children, by their title: the first argv
        element once set (setproctitle), the last one while a child starts (or an orphan)."""
        found = []
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    cmdline = child.cmdline()
                    if any(a.startswith("sglang::") for a in {*cmdline[:1], *cmdline[-1:]}):
                        found.append(child)
        for child in found:
            if all(child.pid != k.pid for k in self.known_children):
                self.known_children.append(child)
        return found

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def cleanup(self) -> None:
        """Kill everything this launch started, orphans included."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for child in self.known_children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()  # psutil checks the create time: never a reused pid
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        for t in self._threads:
            t.join(5)

    # -- HTTP -----------------------------------------------------------------------------

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str, timeout: float = 10.0) -> httpx.Response:
        return httpx.get(self.url(path), timeout=timeout)

    def post(self, path: str, body: Any, timeout: float = 10.0) -> httpx.Response:
        return httpx.post(self.url(path), json=body, timeout=timeout)

    def generate(self, max_new_tokens: int = 8, timeout: float = 10.0) -> httpx.Response:
        return self.post(
            "/generate",
            {
                "text": "Say hello in one word",
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            },
            timeout,
        )

    def chat(self, max_tokens: int = 10, timeout: float = 10.0) -> httpx.Response:
        # The seed incident's smoke test.
        return self.post(
            "/v1/chat/completions",
            {
                "model": "/shared/kimi-k2.5-int4",
                "messages": [{"role": "user", "content": "Say hello in one word"}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
            timeout,
        )

    def metric(self, name: str, **labels: str) -> float:
        """The value of the first sample of `name` carrying `labels` (other labels ignored)."""
        for line in self.get("/metrics").text.splitlines():
            named = line.startswith(name + "{") or line.startswith(name + " ")
            if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} {labels} not in /metrics")

    def port_open(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0


class Launcher:
    """Starts stand-ins (`launcher(*flags)`: ready unless `ready=False`) and kills all of them,
    orphans included, at `cleanup()` or the end of a `with` block."""

    def __init__(self) -> None:
        self.started: list[Standin] = []

    def __call__(
        self,
        *flags: str,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        ready: bool = True,
    ) -> Standin:
        port = port or free_port()
        standin = Standin(["--model-path", MODEL, "--port", str(port), *flags], env or {}, port)
        self.started.append(standin)
        if ready:
            standin.wait_ready()
        return standin

    def cleanup(self) -> None:
        for standin in self.started:
            standin.cleanup()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
