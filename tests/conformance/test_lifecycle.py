"""How a server ends: SIGTERM, a killed scheduler, a scheduler that raises (with and without
SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION). Each test starts its own server of each side.

Real SGLang 0.5.23 is the reference (docs/sglang.md, "Observed on the real server (CPU)").
Where the real server's timing depends on the host (the crash-dump phase without the KILLPG
variable: about 5 s on a CPU, where no CUDA coredump is waited for; about a minute on a GPU
host), only the first seconds are asserted.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import httpx
import psutil
import pytest

from testkit.conformance import SCHEDULER_EXCEPTION, Launch, Server, titled

pytestmark = pytest.mark.slow

TRACEBACK = r"Scheduler hit an exception: Traceback \(most recent call last\):"
ATTRIBUTE_ERROR = (
    r"AttributeError: 'EAGLEWorkerV2' object has no attribute 'spec_disable_batch_threshold'"
)
SIGQUIT_RUNNING = (
    r"SIGQUIT received\. signum=None, frame=None\. It usually means one child failed\."
)
DIAGNOSTICS = r"Sleeping 5 seconds before crash diagnostics to let GPU activity settle\."


def unanswered(server: Server, path: str, seconds: float) -> bool:
    """True when `path` gets no answer within `seconds` (SGLang's handlers are blocked)."""
    try:
        if path == "/generate":
            server.generate(4, timeout=seconds)
        else:
            server.get(path, timeout=seconds)
    except httpx.TimeoutException:
        return True
    except httpx.TransportError:
        return True  # the connection went down with the process: no answer either
    return False


def decode_in_background(server: Server) -> threading.Thread:
    def run() -> None:
        # The scheduler dies under it: no answer is the expected outcome.
        with contextlib.suppress(httpx.HTTPError):
            server.generate(8, timeout=120)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_sigterm_drains_and_exits_0_leaving_nothing(launch: Launch) -> None:
    # SPT_NOENV=1 (the shipped config's): titles set, environment still readable.
    s = launch(env={"SPT_NOENV": "1", "KIMI_CONFORMANCE_MARKER": "m1"})
    children = titled(s.group())
    assert set(children) == {"sglang::scheduler", "sglang::detokenizer"}
    for proc in children.values():
        assert proc.environ().get("KIMI_CONFORMANCE_MARKER") == "m1"
    group = s.group()
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit(timeout=30) == 0
    _, alive = psutil.wait_procs(group, timeout=10)
    assert not alive, [p.pid for p in alive]


def test_scheduler_sigkill_main_logs_waits_5s_and_dies_by_sigkill(launch: Launch) -> None:
    s = launch()
    scheduler = titled(s.group())["sglang::scheduler"]
    scheduler.kill()
    killed_at = time.monotonic()
    s.wait_log(
        rf"Subprocess scheduler_0 \(pid={scheduler.pid}\) crashed with exit code -9\. "
        r"Triggering SIGQUIT for cleanup\.\.\.",
        timeout=10,
    )
    s.wait_log(SIGQUIT_RUNNING, timeout=5)
    s.wait_log(DIAGNOSTICS, timeout=5)
    assert unanswered(s, "/health", 1.5)
    assert unanswered(s, "/generate", 1.0)
    assert s.wait_exit(timeout=30) == -signal.SIGKILL
    took = time.monotonic() - killed_at
    assert 4.5 <= took <= 15, took


def test_scheduler_exception_with_killpg_kills_the_group_by_signal_9(launch: Launch) -> None:
    s = launch(fault=SCHEDULER_EXCEPTION, env={"SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION": "1"})
    assert s.get("/health").status_code == 200  # a 1-token request: prefill only
    group = s.group()
    decode_in_background(s)
    s.wait_log(TRACEBACK, timeout=30)
    raised_at = time.monotonic()
    assert s.wait_exit(timeout=10) == -signal.SIGKILL
    assert time.monotonic() - raised_at < 3, "no crash-dump phase"
    s.wait_log(ATTRIBUTE_ERROR, timeout=1)
    _, alive = psutil.wait_procs(group, timeout=5)
    assert not alive, [p.pid for p in alive]


def test_scheduler_exception_without_killpg_first_seconds(launch: Launch) -> None:
    s = launch(fault=SCHEDULER_EXCEPTION)
    assert s.get("/health").status_code == 200
    decode_in_background(s)
    s.wait_log(TRACEBACK, timeout=30)
    s.wait_log(ATTRIBUTE_ERROR, timeout=1)
    s.wait_log(SIGQUIT_RUNNING, timeout=5)
    s.wait_log(DIAGNOSTICS, timeout=5)
    # The crash-dump phase: the main process lives on, and nothing answers.
    assert unanswered(s, "/generate", 1.0)
    assert s.proc.poll() is None, "alive during the crash-dump phase"
