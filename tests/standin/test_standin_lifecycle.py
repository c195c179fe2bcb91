"""Start-up, shutdown and the process tree, with real processes and signals."""

from __future__ import annotations

import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from testkit import free_port, wait_gone, wait_until
from testkit.standin import BOUND_LINE, DEADLINE, READY_LINE, Launcher


def test_sigterm_drains_in_flight_requests_then_exits_0(launch: Launcher) -> None:
    s = launch("--tp-size", "2", env={"STANDIN_DECODE_SECONDS_PER_TOKEN": "0.005"})
    children = s.children()
    assert len(children) == 3
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(s.generate, 300)  # about 1.5 s of decoding
        wait_until(
            lambda: s.metric("sglang:num_running_reqs") == 1, DEADLINE, "the long decode to run"
        )
        s.signal(signal.SIGTERM)
        wait_until(lambda: s.get("/health").status_code == 503, DEADLINE, "/health to say 503")
        assert s.get("/ready").status_code == 503
        assert s.generate(2).status_code == 200  # SGLang still accepts requests while draining
        r = long.result(timeout=15)
    assert r.status_code == 200
    assert r.json()["meta_info"]["completion_tokens"] == 300
    assert s.wait_exit() == 0
    s.wait_line("Gracefully exiting... Remaining number of requests 0.")
    assert not wait_gone(children, DEADLINE)
    assert s.stdout == b"", "logs go to stderr only"


def test_children_die_when_the_parent_is_sigkilled(launch: Launcher) -> None:
    s = launch("--tp-size", "2")
    children = s.children()
    assert len(children) == 3
    s.signal(signal.SIGKILL)  # the parent alone, not its group
    assert s.wait_exit() == -signal.SIGKILL
    assert not wait_gone(children, 5)


def test_health_is_503_until_warmed_up_and_sigint_exits_0(launch: Launcher) -> None:
    s = launch(env={"STANDIN_WARMUP_SECONDS": "1.0"}, ready=False)
    s.wait_line(BOUND_LINE)
    assert s.count(READY_LINE) == 0
    assert s.get("/health").status_code == 503  # ServerStatus.Starting
    assert s.get("/ready").status_code == 503
    s.wait_ready()
    assert s.get("/health").status_code == 200
    children = s.children()
    s.signal(signal.SIGINT)
    assert s.wait_exit() == 0
    assert not wait_gone(children, DEADLINE)


def test_bind_failure_exits_1_after_loading(launch: Launcher) -> None:
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        s = launch(port=port, env={"STANDIN_LOAD_SECONDS": "0.5"}, ready=False)
        s.wait_line("Load weight begin")
        children = s.children()
        assert s.wait_exit() == 1
    line = s.wait_line("error while attempting to bind on address")
    assert "[Errno 98]" in line and "address already in use" in line
    assert s.count("Load weight end") == 1, "like SGLang, it fails only after loading"
    assert not wait_gone(children, DEADLINE)


def test_sigterm_while_loading_exits_0(launch: Launcher) -> None:
    s = launch(env={"STANDIN_LOAD_SECONDS": "30"}, ready=False)
    s.wait_line("Init torch distributed begin")
    children = s.children()
    assert len(children) == 2
    assert not s.port_open()
    s.signal(signal.SIGTERM)
    assert s.wait_exit() == 0
    assert not wait_gone(children, DEADLINE)


def test_a_killed_scheduler_takes_the_main_process_down_after_five_seconds(
    launch: Launcher,
) -> None:
    # Real SGLang 0.5.23: the subprocess watchdog (utils/watchdog.py:217) SIGQUITs the main
    # process, which sleeps 5 s "before crash diagnostics" and SIGKILLs its own tree.
    s = launch()
    tp0 = next(c for c in s.children() if c.cmdline()[0] == "sglang::scheduler")
    tp0.kill()
    killed_at = time.monotonic()
    s.wait_line(f"Subprocess scheduler_0 (pid={tp0.pid}) crashed with exit code -9.")
    s.wait_line("Sleeping 5 seconds before crash diagnostics")
    with pytest.raises(httpx.TimeoutException):
        s.get("/health", timeout=1.0)  # nothing answers meanwhile
    assert s.wait_exit() == -signal.SIGKILL
    assert time.monotonic() - killed_at >= 5.0


def test_fault_on_the_kth_launch_only(launch: Launcher, tmp_path: Path) -> None:
    env = {
        "STANDIN_LAUNCH_COUNTER": str(tmp_path / "launches"),
        "STANDIN_FAULT": "crash-during-load",
        "STANDIN_FAULT_LAUNCH": "1",
    }
    first = launch(env=env, ready=False)
    assert first.wait_exit() == 1
    first.wait_line("launch 1; faults: crash-during-load")
    second = launch(env=env)
    second.wait_line("launch 2; faults: none")
    assert second.generate().status_code == 200
    assert (tmp_path / "launches").read_text().strip() == "2"


def test_a_misspelt_fault_is_an_error(launch: Launcher) -> None:
    s = launch(env={"STANDIN_FAULT": "decode-hnag"}, ready=False)
    assert s.wait_exit() == 2
    assert "decode-hnag" in s.wait_line("unknown fault")


def test_flood_only_prints_the_lines_and_exits_0(launch: Launcher) -> None:
    started = time.monotonic()
    s = launch(
        env={
            "STANDIN_FAULT": "log-flood",
            "STANDIN_FLOOD_LINES": "50000",
            "STANDIN_FLOOD_ONLY": "1",
        },
        ready=False,
    )
    assert s.wait_exit() == 0
    assert s.count("Decode batch") == 50000
    assert time.monotonic() - started < 10
