"""Runs the real `kimi-serve run` as a process against the real stand-in, and watches it.

Synchronisation is on what the daemon says: its JSON log lines arrive on a queue as they are
printed (a reader thread), and `wait_state()` blocks on that queue, not on a clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from testkit.procs import kill_owned, owned_processes, wait_gone
from testkit.wait import free_port

BIN = Path(sys.executable).parent / "kimi-serve"


def base_config(tmp: Path, **overrides: Any) -> dict[str, Any]:
    """A config for the stand-in with short timings; `overrides` are merged per section."""
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"]}\n')
    cfg: dict[str, Any] = {
        "sglang": {
            "python": sys.executable,
            "module": "supervisor.standin",
            "model_path": str(model),
            "host": "127.0.0.1",
            "port": free_port(),
            "args": {
                "tp-size": 2,
                "speculative-algorithm": "EAGLE3",
                "speculative-eagle-topk": 1,
                "speculative-num-draft-tokens": 4,
                "enable-metrics": True,
            },
            "env": {
                "STANDIN_LOAD_SECONDS": "0.3",
                "STANDIN_WARMUP_SECONDS": "0.1",
                "STANDIN_LAUNCH_COUNTER": str(tmp / "launches"),
                "STANDIN_CRASH_SLEEP_SECONDS": "65",
            },
        },
        "profiles": {
            "fallback": {
                "args": {
                    "speculative-algorithm": None,
                    "speculative-eagle-topk": None,
                    "speculative-num-draft-tokens": None,
                }
            }
        },
        "readiness": {"load_timeout": "20s", "probe": {"max_tokens": 8, "timeout": "3s"}},
        "liveness": {"interval": "0.5s", "timeout": "1s", "failure_threshold": 2},
        "restart": {
            "backoff_initial": "0.1s",
            "backoff_max": "0.5s",
            "crash_loop": {"max_restarts": 4, "window": "1h"},
            "fallback_profile": None,
        },
        "stop": {"drain_timeout": "3s"},
        "gpus": {"manage": False},
        "admin": {"listen": f"127.0.0.1:{free_port()}"},
        "state_dir": str(tmp / "state"),
        "logging": {"format": "json", "level": "info"},
    }
    for section, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(section), dict):
            _merge(cfg[section], value)
        else:
            cfg[section] = value
    return cfg


def primary_crashes_config(tmp: Path) -> dict[str, Any]:
    """base_config whose primary profile crashes during every load and whose fallback loads:
    after two crashes (the crash loop) the daemon serves on the fallback."""
    return base_config(
        tmp,
        sglang={"env": {"STANDIN_FAULT": "crash-during-load"}},
        profiles={"fallback": {"env": {"STANDIN_FAULT": None}}},
        restart={"crash_loop": {"max_restarts": 2, "window": "1h"}, "fallback_profile": "fallback"},
    )


def _merge(into: dict[str, Any], new: Mapping[str, Any]) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


@dataclass
class DaemonProcess:
    proc: subprocess.Popen[str]
    config_path: Path
    cfg: dict[str, Any]
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    seen: list[dict[str, Any]] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        path: Path,
        cfg: dict[str, Any],
        env: Mapping[str, str],
        preexec_fn: Callable[[], Any] | None = None,
        command: Sequence[str] = (),
    ) -> DaemonProcess:
        """`kimi-serve run --config path`, its output read by a thread as it comes. `command`
        replaces the `kimi-serve` executable (an interpreter and its arguments)."""
        proc = subprocess.Popen(
            [*(command or [str(BIN)]), "run", "--config", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            preexec_fn=preexec_fn,
        )
        d = cls(proc, path, cfg)
        d.reader = threading.Thread(target=d._read, daemon=True)
        d.reader.start()
        return d

    @property
    def admin(self) -> str:
        return f"http://{self.cfg['admin']['listen']}"

    @property
    def owner(self) -> str:
        return str(Path(self.cfg["state_dir"]).resolve())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.raw.append(line)
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                self.events.put(doc)
        self.events.put({"event": "__eof__"})

    def next_event(self, until: float) -> dict[str, Any]:
        remaining = until - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        try:
            ev = self.events.get(timeout=remaining)
        except queue.Empty:
            raise TimeoutError from None
        self.seen.append(ev)
        return ev

    def wait_for(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 20.0, what: str = ""
    ) -> dict[str, Any]:
        until = time.monotonic() + timeout
        while True:
            try:
                ev = self.next_event(until)
            except TimeoutError:
                states = [e.get("new") for e in self.seen if e.get("event") == "state"]
                raise AssertionError(
                    f"timed out waiting for {what}; states so far {states}; "
                    f"last lines: {self.raw[-15:]}"
                ) from None
            if ev.get("event") == "__eof__":
                raise AssertionError(f"daemon exited while waiting for {what}: {self.raw[-15:]}")
            if pred(ev):
                return ev

    def wait_state(self, state: str, timeout: float = 20.0) -> dict[str, Any]:
        return self.wait_for(
            lambda e: e.get("event") == "state" and e.get("new") == state, timeout, state
        )

    def wait_reason(
        self, reason: str, timeout: float = 20.0, new: str | None = None
    ) -> dict[str, Any]:
        """The next state event with this reason (into state `new`, if given)."""
        return self.wait_for(
            lambda e: (
                e.get("event") == "state"
                and e.get("reason") == reason
                and new in (None, e.get("new"))
            ),
            timeout,
            f"{reason} ({new or 'any state'})",
        )

    def states(self) -> list[str]:
        """States seen so far, including events not yet waited for."""
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                break
            if ev.get("event") != "__eof__":
                self.seen.append(ev)
        return [e["new"] for e in self.seen if e.get("event") == "state"]

    @property
    def token_file(self) -> Path:
        """The admin token the daemon creates at start (default <state_dir>/admin.token)."""
        return Path(self.cfg.get("admin", {}).get("token_file") or Path(self.owner) / "admin.token")

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}

    def status(self) -> dict[str, Any]:
        """The whole /status document (with the admin token)."""
        r = httpx.get(self.admin + "/status", timeout=5, headers=self.auth())
        r.raise_for_status()
        doc: dict[str, Any] = r.json()
        return doc

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.admin + path, timeout=5)

    def post(self, path: str, token: bool = True) -> httpx.Response:
        """POST to the admin endpoint, with the admin token unless `token` is False."""
        headers = self.auth() if token else {}
        return httpx.post(self.admin + path, timeout=5, headers=headers, trust_env=False)

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        if self.reader is not None:
            self.reader.join(5)
        return code

    def sglang_pid(self) -> int:
        child = self.status()["child"]
        assert child, "no SGLang child"
        return int(child["pid"])


@contextlib.contextmanager
def running(
    tmp: Path, cfg: dict[str, Any], env: Mapping[str, str] | None = None
) -> Iterator[DaemonProcess]:
    """Start the daemon; on exit stop it and prove nothing of ours is left alive."""
    path = tmp / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    full_env = {**os.environ, **(env or {})}
    full_env.pop("NOTIFY_SOCKET", None)
    with reaped(DaemonProcess.start(path, cfg, full_env)) as d:
        yield d


@contextlib.contextmanager
def reaped(d: DaemonProcess) -> Iterator[DaemonProcess]:
    """Yield the started daemon; on exit stop it and prove nothing of ours is left alive."""
    try:
        yield d
    finally:
        try:
            if d.proc.poll() is None:
                d.stop()
        finally:
            left = wait_gone(owned_processes(d.owner), timeout=5)
            kill_owned(d.owner)
            assert not left, f"processes left behind: {[p.pid for p in left]}"


def log_time(event: dict[str, Any]) -> float:
    """Unix time of one of the daemon's JSON log lines."""
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()
