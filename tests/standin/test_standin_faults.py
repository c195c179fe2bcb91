"""Every fault switch, against a real stand-in process."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from testkit import wait_gone, wait_until
from testkit.standin import BOUND_LINE, DEADLINE, READY_LINE, Launcher, gone

SPEC = ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/models/draft")


def test_seed_incident(launch: Launcher) -> None:
    s = launch(
        *SPEC,
        "--tp-size",
        "2",
        env={
            "STANDIN_FAULT": "seed-incident",
            "STANDIN_CRASH_SLEEP_SECONDS": "1.5",
            "SGLANG_HEALTH_CHECK_TIMEOUT": "0.2",
        },
    )
    children = s.children()
    # Everything a health check can see says the server is fine ...
    assert s.get("/health").status_code == 200
    assert s.get("/health_generate").status_code == 200
    assert s.get("/server_info").json()["speculative_algorithm"] == "EAGLE3"
    assert s.generate(max_new_tokens=1).status_code == 200  # the 1-token path is prefill only
    # ... until the first real decode, which never gets an answer.
    with ThreadPoolExecutor(1) as pool:
        probe = pool.submit(s.chat, 10, 15.0)
        s.wait_line("Scheduler hit an exception: Traceback (most recent call last):")
        crashed_at = time.monotonic()
        assert s.get("/health").status_code == 503  # no scheduler answers the health request
        with pytest.raises(httpx.TransportError):
            probe.result(timeout=15)
    head = s.wait_line("Scheduler hit an exception")
    assert head.split("] ", 1)[0].endswith(" TP0")
    s.wait_line('eagle_worker_v2.py", line 702, in forward_batch_generation')
    s.wait_line(
        "AttributeError: 'EAGLEWorkerV2' object has no attribute 'spec_disable_batch_threshold'"
    )
    s.wait_line("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
    # kill_process_tree(include_parent=True): SGLang SIGKILLs itself.
    assert s.wait_exit() == -signal.SIGKILL
    assert time.monotonic() - crashed_at > 1.0, "SGLang lingers before it exits"
    assert not wait_gone(children, DEADLINE)


def test_decode_500_with_health_200(launch: Launcher) -> None:
    s = launch(*SPEC, "--disable-overlap-schedule", env={"STANDIN_FAULT": "decode-500"})
    s.wait_line("Non-overlap (synchronous) spec v2 is used")
    assert s.get("/server_info").json()["disable_overlap_schedule"] is True
    r = s.generate()
    assert r.status_code == 500
    assert r.json()["error"]["message"]
    r = s.chat()
    assert r.status_code == 500
    assert r.json()["object"] == "error"
    assert s.get("/health").status_code == 200
    assert s.get("/ready").status_code == 200


def test_decode_zero_tokens(launch: Launcher) -> None:
    s = launch(env={"STANDIN_FAULT": "decode-zero-tokens"})
    body = s.generate(max_new_tokens=8).json()
    assert (body["text"], body["output_ids"]) == ("", [])
    assert body["meta_info"]["completion_tokens"] == 0
    assert body["meta_info"]["finish_reason"]["type"] == "stop"
    chat = s.chat(max_tokens=10).json()
    assert chat["usage"]["completion_tokens"] == 0
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["choices"][0]["message"]["content"] == ""
    assert s.get("/health").status_code == 200


def test_decode_hang_after_the_first_decode(launch: Launcher) -> None:
    s = launch(env={"STANDIN_FAULT": "decode-hang", "STANDIN_HANG_AFTER_DECODES": "1"})
    assert s.generate().json()["meta_info"]["completion_tokens"] == 8  # the readiness probe
    with pytest.raises(httpx.ReadTimeout):
        s.generate(timeout=0.5)
    started = time.monotonic()
    assert s.get("/health").status_code == 200
    assert time.monotonic() - started < 1.0
    # Hung, not busy: a request is running but no token comes out.
    assert s.metric("sglang:num_running_reqs") == 1
    tokens = s.metric("sglang:generation_tokens_total")
    time.sleep(0.3)  # an observation window, not a synchronisation
    assert s.metric("sglang:generation_tokens_total") == tokens
    # SGLang's drain waits for it with no time limit: only SIGKILL ends this.
    s.signal(signal.SIGTERM)
    s.wait_line("Gracefully exiting... Remaining number of requests 1.")
    with pytest.raises(subprocess.TimeoutExpired):
        s.proc.wait(timeout=0.5)


def test_exit_after(launch: Launcher) -> None:
    s = launch(
        env={"STANDIN_FAULT": "exit-after", "STANDIN_EXIT_AFTER": "0.3", "STANDIN_EXIT_CODE": "3"}
    )
    children = s.children()
    ready_at = time.monotonic()
    assert s.wait_exit() == 3
    assert time.monotonic() - ready_at > 0.2
    s.wait_line("fault exit-after")
    assert not wait_gone(children, DEADLINE)


def test_crash_during_load(launch: Launcher) -> None:
    s = launch(
        env={"STANDIN_FAULT": "crash-during-load", "STANDIN_LOAD_SECONDS": "1.0"}, ready=False
    )
    s.wait_line("Load weight begin")
    children = s.children()
    assert s.wait_exit() == 1
    s.wait_line("Scheduler hit an exception: Traceback (most recent call last):")
    s.wait_line("Exception: Capture cuda graph failed: CUDA out of memory.")
    s.wait_line("Received sigquit from a child process")
    assert s.count(BOUND_LINE) == 0
    assert not wait_gone(children, DEADLINE)


def test_never_ready(launch: Launcher) -> None:
    s = launch(env={"STANDIN_FAULT": "never-ready", "STANDIN_LOAD_SECONDS": "0.4"}, ready=False)
    # A normal load prints 8 progress lines; this one goes on.
    s.wait_line("Loading safetensors checkpoint shards", times=12)
    assert s.count(BOUND_LINE) == 0
    assert s.count(READY_LINE) == 0
    assert not s.port_open()
    children = s.children()
    assert len(children) == 2
    s.signal(signal.SIGTERM)
    assert s.wait_exit() == 0
    assert not wait_gone(children, DEADLINE)


def test_orphans_survive_the_parent_groups_sigkill(launch: Launcher) -> None:
    s = launch("--tp-size", "2", env={"STANDIN_FAULT": "orphans"})
    children = s.children()
    assert len(children) == 3
    for child in children:
        assert os.getpgid(child.pid) == child.pid  # escaped into their own sessions
    os.killpg(s.proc.pid, signal.SIGKILL)  # what a supervisor does to SGLang's group
    assert s.wait_exit() == -signal.SIGKILL
    time.sleep(0.5)  # longer than a child's parent-death poll: they would have noticed
    assert not [c for c in children if gone(c)]
    for child in children:
        child.kill()
    assert not wait_gone(children, DEADLINE)


def test_normal_children_die_with_the_group(launch: Launcher) -> None:
    s = launch("--tp-size", "2")
    children = s.children()
    os.killpg(s.proc.pid, signal.SIGKILL)
    assert s.wait_exit() == -signal.SIGKILL
    assert not wait_gone(children, 5)


def test_ignore_sigterm(launch: Launcher) -> None:
    s = launch(env={"STANDIN_FAULT": "ignore-sigterm"})
    children = s.children()
    s.signal(signal.SIGTERM)
    for child in children:
        child.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        s.proc.wait(timeout=0.5)
    assert not [c for c in children if gone(c)]
    assert s.get("/health").status_code == 200  # not even draining
    assert s.count("SIGTERM received") == 0
    os.killpg(s.proc.pid, signal.SIGKILL)
    assert s.wait_exit() == -signal.SIGKILL
    assert not wait_gone(children, DEADLINE)


def test_slow_decode_is_busy_not_dead(launch: Launcher) -> None:
    s = launch(env={"STANDIN_FAULT": "slow-decode", "STANDIN_SLOW_DECODE_SECONDS": "1.5"})
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        slow = pool.submit(s.generate, 8, 15.0)
        wait_until(
            lambda: s.metric("sglang:num_running_reqs") == 1, DEADLINE, "the slow decode to run"
        )
        # The scheduler's realtime counter moves every batch; the tokenizer manager's
        # generation counter only when a request finishes (as in SGLang 0.5.23).
        tokens = s.metric("sglang:realtime_tokens_total", mode="decode")
        finished = s.metric("sglang:generation_tokens_total")
        wait_until(
            lambda: s.metric("sglang:realtime_tokens_total", mode="decode") > tokens,
            1.0,
            "the realtime decode counter to advance",
        )
        assert s.metric("sglang:generation_tokens_total") == finished
        health_started = time.monotonic()
        assert s.get("/health").status_code == 200
        assert time.monotonic() - health_started < 0.5
        r = slow.result(timeout=15)
    assert r.json()["meta_info"]["completion_tokens"] == 8
    assert time.monotonic() - started >= 1.5


def test_log_flood_then_normal_start(launch: Launcher) -> None:
    s = launch(env={"STANDIN_FAULT": "log-flood", "STANDIN_FLOOD_LINES": "20000"})
    assert s.count("Decode batch") >= 20000
    flood_end = max(i for i, line in enumerate(s.lines) if "#token: 19999," in line)
    assert flood_end < s.lines.index(next(x for x in s.lines if "Load weight begin" in x))
    assert s.generate().status_code == 200


def test_cleanup_leaves_no_process_behind(launch: Launcher) -> None:
    """The fixtures' own promise: everything a launch started is dead after cleanup."""
    s = launch("--tp-size", "2", env={"STANDIN_FAULT": "orphans"})
    children = s.children()
    launch.cleanup()
    assert s.proc.poll() is not None
    assert not wait_gone(children, DEADLINE)


def test_force_shutdown_cuts_a_hung_drain_short(launch: Launcher) -> None:
    s = launch(
        env={
            "STANDIN_FAULT": "decode-hang",
            "STANDIN_HANG_AFTER_DECODES": "0",
            "SGL_FORCE_SHUTDOWN": "1",
        }
    )
    with pytest.raises(httpx.ReadTimeout):
        s.generate(timeout=0.3)
    s.signal(signal.SIGTERM)
    assert s.wait_exit() == 0
    s.wait_line("Signal SIGTERM received while force shutdown flag set. Force exiting.")


def test_decode_hang_spares_the_readiness_probe_and_its_canary_by_default(
    launch: Launcher,
) -> None:
    # The default spares two decodes: the readiness probe and the gate's canary, so a daemon
    # becomes ready and the hang comes while serving (docs/standin.md).
    s = launch(env={"STANDIN_FAULT": "decode-hang"})
    assert s.generate().json()["meta_info"]["completion_tokens"] == 8
    assert s.generate().json()["meta_info"]["completion_tokens"] == 8
    with pytest.raises(httpx.ReadTimeout):
        s.generate(timeout=0.5)
