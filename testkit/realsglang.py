"""Start a real SGLang 0.5.23 server on this CPU-only machine, for tests.

`tools/sglang-env` builds the environment (real SGLang, stock torch, a tiny random Llama);
this module starts `python -m sglang.launch_server` on a free port with the flags and
environment that make it serve on a CPU (docs/realsglang.md), its output going to a log
file, and waits for SGLang's own ready line. Each start costs 20-35 s on two cores: share one
server per module or session (tests/conformance/conftest.py does).

The daemon side: `daemon_config(tmp, sgl)` is the real `kimi-serve run`'s config over such a
server, `real_daemon(tmp, cfg)` runs it (`Real`: the daemon, its SGLang's URL and processes).

`KIMI_TEST_FAULT=decode-attributeerror` in `env` makes the real scheduler raise the seed
incident's AttributeError on its first decode batch after the warmup
(tests/realsglang/faulthook/sitecustomize.py).

`canary_env(sgl)` is the same environment serving the confident canary model of
tools/make-canary-model instead of the random tiny one (built on first use, about 30 s, then
cached by its stamp); `CANARY_PROMPT` is the prompt it continues confidently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import yaml

from supervisor.sglang.logscan import READY_LINE
from testkit.daemon import DaemonProcess, _merge, base_config
from testkit.daemon import running as run_daemon
from testkit.paths import REPO_ROOT
from testkit.sglang_cpu import CPU_ARGS, CPU_FLAGS
from testkit.wait import free_port

STUB_DIR = REPO_ROOT / "tools" / "sglang-env.d"
FAULT_HOOK_DIR = REPO_ROOT / "tests" / "realsglang" / "faulthook"
BUILD_TIMEOUT = 1200.0  # a fresh machine installs ~6 GB; a built environment answers at once
START_TIMEOUT = 180.0
SERVER_FLAGS = CPU_FLAGS
CANARY_MAKER = REPO_ROOT / "tools" / "make-canary-model"
# A line of tools/sglang-env.d/corpus.txt inside the passage the canary model learnt by heart
# (tools/make-canary-model CANARY_PROMPT): its greedy continuation of 16 tokens has a top-1/top-2
# logprob margin of several nats at every position (docs/realsglang.md).
CANARY_PROMPT = "Events carry the launch number, so a late probe result"
CANARY_TOKENS = 16
# KIMI_TEST_FAULT values (tests/realsglang/faulthook/sitecustomize.py has what each does).
DECODE_ATTRIBUTEERROR = "decode-attributeerror"
PERTURBED_WEIGHTS = "perturbed-weights"
SLOW_DECODE = "slow-decode"


@dataclasses.dataclass(frozen=True)
class SGLangEnv:
    python: str
    model: str


def build_env() -> SGLangEnv:
    """The built environment (tools/sglang-env; SGLANG_ENV_DIR chooses where), or a skip."""
    import pytest  # here, not at the top: `python -m bench --help` runs without the test tools

    if os.environ.get("KIMI_SERVE_SKIP_SGLANG_ENV") == "1":
        pytest.skip("KIMI_SERVE_SKIP_SGLANG_ENV=1: real SGLang is not available here")
    tool = str(REPO_ROOT / "tools" / "sglang-env")
    return SGLangEnv(
        python=_tool_output("sglang-env", [tool]),
        model=_tool_output("sglang-env", [tool, "--model"]),
    )


def _tool_output(name: str, argv: list[str]) -> str:
    """The last line tools/`name` printed (a path), or the test fails with its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False)
    if proc.returncode != 0:
        import pytest

        pytest.fail(f"tools/{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1]


@functools.cache
def canary_model(python: str) -> str:
    """The canary model's directory, <env>/canary-model beside the tiny model, made by
    tools/make-canary-model with the environment's `python` (built if missing or stale, about
    30 s on two cores; a stamped, verified build answers at once)."""
    out = Path(python).absolute().parents[1] / "canary-model"  # <env>/bin/python: no resolve()
    return _tool_output("make-canary-model", [python, str(CANARY_MAKER), str(out)])


def canary_env(sgl: SGLangEnv) -> SGLangEnv:
    """`sgl` serving the canary model: pass it to start()/running() or to the conftest's
    daemon_config() as is."""
    return dataclasses.replace(sgl, model=canary_model(sgl.python))


def perturbed_env(scale: float = 1.0, seed: int = 0) -> dict[str, str]:
    """Server environment for KIMI_TEST_FAULT=perturbed-weights: noise of `scale` x each
    tensor's std added to the weights right after load (same `seed`, same noise)."""
    return {
        "KIMI_TEST_FAULT": PERTURBED_WEIGHTS,
        "KIMI_TEST_PERTURB_SCALE": f"{scale:g}",
        "KIMI_TEST_PERTURB_SEED": str(seed),
    }


def slow_decode_env(seconds: float, *, file: Path | None = None, after: int = 0) -> dict[str, str]:
    """Server environment for KIMI_TEST_FAULT=slow-decode: each decode batch that holds a
    request other than SGLang's warmup sleeps `seconds`; after the first `after` such batches
    only, and with `file` only while that file exists (create it to slow a running server down,
    remove it to speed it up)."""
    env = {
        "KIMI_TEST_FAULT": SLOW_DECODE,
        "KIMI_TEST_SLOW_DECODE_SECONDS": f"{seconds:g}",
        "KIMI_TEST_SLOW_DECODE_AFTER": str(after),
    }
    if file is not None:
        env["KIMI_TEST_SLOW_DECODE_FILE"] = str(file)
    return env


def greedy_answer(
    client: httpx.Client, url: str, text: str = CANARY_PROMPT, tokens: int = CANARY_TOKENS
) -> dict[str, Any]:
    """One greedy generation (`/generate`, temperature 0, ignore_eos, return_logprob with
    top_logprobs_num 2): its text, token ids and their logprobs, top-1 minus top-2 logprob per
    position (nats),
    cached prompt tokens (radix-cache hit when > 0) and SGLang's meta_info."""
    r = client.post(
        url + "/generate",
        json={
            "text": text,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
        timeout=300,
    )
    r.raise_for_status()
    doc = r.json()
    meta = doc["meta_info"]
    return {
        "text": doc["text"],
        "ids": [int(t[1]) for t in meta["output_token_logprobs"]],
        "logprobs": [float(t[0]) for t in meta["output_token_logprobs"]],
        "margins": [float(top[0][0]) - float(top[1][0]) for top in meta["output_top_logprobs"]],
        "cached_tokens": int(meta.get("cached_tokens") or 0),
        "meta_info": meta,
    }


def server_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a real server needs on a CPU, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STANDIN_", "KIMI_TEST_"))}
    env.update(
        {
            # Without it --device cpu is not enough (sglang/srt/utils/common.py:221).
            "SGLANG_USE_CPU_ENGINE": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join([str(STUB_DIR), str(FAULT_HOOK_DIR)]),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra or {})
    return env


def server_argv(
    sgl: SGLangEnv,
    port: int,
    extra: Sequence[str] = (),
    *,
    python: str | None = None,
    module: str = "sglang.launch_server",
) -> list[str]:
    """The server's command line (`python -m module`: the stand-in takes the same flags)."""
    return [
        python or sgl.python,
        "-m",
        module,
        "--model-path",
        sgl.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SERVER_FLAGS,
        *extra,
    ]


@dataclasses.dataclass
class RealServer:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    started_in: float = 0.0  # launch -> ready line, seconds

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first match of `pattern` in the log, waiting up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            m = rx.search(self.log())
            if m:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{pattern!r} not in the log after {timeout:g} s:\n{self.log()[-3000:]}"
                )
            if self.proc.poll() is not None and not rx.search(self.log()):
                raise AssertionError(
                    f"server exited {self.proc.returncode} before {pattern!r}:\n"
                    f"{self.log()[-3000:]}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGKILL the whole process group (SGLang's children are in it) and reap."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


S = TypeVar("S", bound=RealServer)


def start(
    sgl: SGLangEnv,
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    timeout: float = START_TIMEOUT,
) -> RealServer:
    """Launch a real server in its own session and wait for its ready line."""
    port = free_port()
    return spawn(
        server_argv(sgl, port, args),
        server_env(env),
        log_path,
        port,
        timeout,
        lambda proc: RealServer(proc, port, log_path),
    )


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: Path,
    port: int,
    timeout: float,
    handle: Callable[[subprocess.Popen[bytes]], S],
) -> S:
    """Start `argv` in its own session, its output to `log_path`, and wait for SGLang's ready
    line; `handle(proc)` is the server handle returned (stopped if the wait fails)."""
    t0 = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=log_path.parent,
            start_new_session=True,
        )
    server = handle(proc)
    try:
        server.wait_log(re.escape(READY_LINE), timeout)
    except BaseException:
        server.stop()
        raise
    server.started_in = time.monotonic() - t0
    return server


@contextlib.contextmanager
def running(
    sgl: SGLangEnv,
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    timeout: float = START_TIMEOUT,
) -> Iterator[RealServer]:
    server = start(sgl, log_path, env=env, args=args, timeout=timeout)
    try:
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------- the daemon over a real server

PROBE_TOKENS = 8
LOAD_TIMEOUT = 240.0  # launch -> ready on a busy 2-core machine took up to 80 s


def daemon_config(
    tmp: Path,
    sgl: SGLangEnv,
    *,
    args: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    **sections: Any,
) -> dict[str, Any]:
    cfg = base_config(tmp)
    cfg["sglang"] = {
        "python": sgl.python,
        "module": "sglang.launch_server",
        "model_path": sgl.model,
        "host": "127.0.0.1",
        "port": free_port(),
        "args": {**CPU_ARGS, **(args or {})},
        "env": {
            # What a real server needs on a CPU (server_env()).
            "SGLANG_USE_CPU_ENGINE": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join([str(STUB_DIR), str(FAULT_HOOK_DIR)]),
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


@dataclasses.dataclass
class Real:
    """A running daemon with a real SGLang under it."""

    d: DaemonProcess
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
    with run_daemon(tmp, cfg) as d:
        yield Real(d, tmp)


def generate(
    url: str,
    max_new_tokens: int,
    text: str = "Tell me a story.",
    timeout: float = 300.0,
    key: str | None = None,
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
        headers={} if key is None else {"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )
    r.raise_for_status()
    doc: dict[str, Any] = r.json()
    return doc


def alive_pids(pids: object) -> list[int]:
    """Those of `pids` still running (a zombie has exited)."""
    assert isinstance(pids, (list, set, tuple, dict))
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


def report(name: str, value: float, unit: str = "s") -> None:
    """One measured figure, printed for docs/benchmarks.md (run with -s to see it)."""
    print(f"\n[realsglang] {name}: {value:.3f} {unit}")
