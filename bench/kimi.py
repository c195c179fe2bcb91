"""kimi-serve under test: the real `kimi-serve run` process against the real stand-in.

The config starts from the integration tests' `base_config` (testkit/daemon.py)
and changes only what a benchmark needs to be explicit about: the stand-in's load and warmup
times, restart back-off 0 (so a recovery shows mechanism, not policy; production waits 5 s
and the table says so), no crash-loop cut-off, and production liveness timings unless a
scenario asks otherwise.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from bench.common import PYTHON, BenchError, Lines, NotifySocket, Procs, state_is, write_yaml
from supervisor import config as config_mod
from supervisor.sglang import argv as command
from testkit import base_config, kill_owned, owned_processes, wait_gone

BIN = PYTHON.parent / "kimi-serve"

# Production's liveness (etc/kimi-serve.yaml): a decode probe every 15 s, 20 s timeout, 3 strikes.
PRODUCTION_LIVENESS = {"interval": "15s", "timeout": "20s", "failure_threshold": 3}


def model_dir(work: Path) -> str:
    """A directory that passes preflight's model check (config.json present)."""
    d = work / "model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}\n")
    return str(d)


def bench_config(
    work: Path,
    *,
    load_s: float,
    warmup_s: float,
    env: dict[str, str] | None = None,
    liveness: dict[str, Any] | None = None,
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    standin_env = {
        "STANDIN_LOAD_SECONDS": f"{load_s:g}",
        "STANDIN_WARMUP_SECONDS": f"{warmup_s:g}",
        "STANDIN_LAUNCH_COUNTER": str(work / "launches"),
        "STANDIN_CRASH_SLEEP_SECONDS": "65",
        **(env or {}),
    }
    return base_config(
        work,
        sglang={"model_path": model_dir(work), "env": standin_env},
        readiness={"load_timeout": "60s", "probe": {"timeout": "30s"}},
        liveness=liveness or PRODUCTION_LIVENESS,
        restart={
            "backoff_initial": "0s",
            "backoff_max": "1s",
            "crash_loop": {"max_restarts": 10_000, "window": "1h"},
        },
        stop={"drain_timeout": "5s"},
    )


def launch_spec(cfg: dict[str, Any], work: Path) -> command.LaunchSpec:
    """The exact argv and env kimi-serve launches for this config: the baselines run the same."""
    return command.build(config_mod.load(str(write_yaml(work / "argv-check.yaml", cfg))))


def _sglang_line(line: str) -> bool:
    """SGLang's forwarded lines, most of the daemon's output under load: counted, not parsed."""
    return '"source": "sglang"' in line


class KimiServe:
    def __init__(
        self,
        procs: Procs,
        work: Path,
        cfg: dict[str, Any],
        notify: NotifySocket | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.procs, self.work, self.cfg = procs, work, cfg
        self.env = dict(env or {})
        if notify is not None:
            self.env["NOTIFY_SOCKET"] = str(notify.path)
        self.admin = f"http://{cfg['admin']['listen']}"
        self.port = int(cfg["sglang"]["port"])
        self.owner = str(Path(cfg["state_dir"]).resolve())
        self.proc: subprocess.Popen[str] | None = None
        self.lines: Lines | None = None

    def start(self) -> KimiServe:
        path = write_yaml(self.work / "kimi-serve.yaml", self.cfg)
        self.proc = self.procs.start(
            [BIN, "run", "--config", path],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines = Lines(self.proc.stdout, skip=_sglang_line)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_state(self, new: str, timeout: float, start: int = 0) -> tuple[int, dict[str, Any]]:
        assert self.lines is not None
        return self.lines.wait(state_is(new), timeout, start)

    def child_pid(self) -> int:
        assert self.lines is not None
        launched = self.lines.find(lambda e: e.get("event") == "launched sglang")
        if not launched:
            raise BenchError("kimi-serve launched no SGLang")
        return int(launched[-1]["pid"])

    def stop(self) -> list[int]:
        """Stop the daemon (SIGTERM) and return the pids of any SGLang process left behind
        (they are killed as well, but a leftover is a finding)."""
        if self.proc is not None:
            self.procs.stop(self.proc, timeout=30)
        left = wait_gone(owned_processes(self.owner), timeout=5)
        kill_owned(self.owner)
        return [p.pid for p in left]
