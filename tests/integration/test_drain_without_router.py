"""`kimi-serve drain` without `router.url`, end to end: the real daemon with the stand-in on
loopback. Nothing to deregister, but the drain still waits until SGLang reports no running and
no queued request (its /metrics), bounded by `router.drain_timeout`, and says what it waited
for."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit import BIN, base_config, running, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SECONDS_PER_TOKEN = 0.002  # the stand-in's default decode speed


def cli(config: Path, *command: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """The real command, and the monotonic time it returned."""
    env = {k: v for k, v in os.environ.items() if k not in ("KIMI_SERVE_CONFIG", "NOTIFY_SOCKET")}
    done = subprocess.run(
        [str(BIN), *command, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done, time.monotonic()


def answer(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stdout + done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)  # drain --json: the daemon's answer
    return doc


def generate(url: str, rid: str, tokens: int) -> float:
    """One user request; returns the monotonic time its answer came."""
    body = {"rid": rid, "text": "Tell me a story", "sampling_params": {"max_new_tokens": tokens}}
    r = httpx.post(url + "/generate", json=body, timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    return time.monotonic()


def running_requests(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("sglang:num_running_reqs")
    )


def test_drain_without_a_router_waits_for_sglang_then_gives_up_at_the_timeout(
    tmp_path: Path,
) -> None:
    cfg = base_config(tmp_path, router={"drain_timeout": "1.5s"})
    sglang = f"http://127.0.0.1:{cfg['sglang']['port']}"
    pool = concurrent.futures.ThreadPoolExecutor(2)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")

        # A request of ~1 s is running: the drain answers only after it ended.
        rid = f"drain-long-{os.getpid()}"
        long = pool.submit(generate, sglang, rid, int(1.0 / SECONDS_PER_TOKEN))
        wait_until(lambda: running_requests(sglang) > 0, 10, "the long request running")
        done, returned = cli(d.config_path, "drain", "--json")
        doc = answer(done)
        assert long.done(), "drain answered while the request was still running"
        assert long.result() <= returned
        assert doc["router"] is None and "router.url is not set" in doc["note"]
        assert doc["drain"]["idle"] is True and doc["drain"]["error"] is None, doc
        assert doc["drain"]["waited_s"] > 0.2, doc
        assert (doc["drain"]["running"], doc["drain"]["queued"]) == (0, 0)
        assert "sglang:num_running_reqs + sglang:num_queue_reqs" in doc["waited_for"]
        assert f"{sglang}/metrics" in doc["waited_for"]
        assert "router.drain_timeout 1.5s" in doc["waited_for"]
        assert d.status()["state"] == "draining"
        assert d.get("/readyz").status_code == 503
        # SGLang keeps running and serving whoever still talks to it directly.
        assert httpx.get(sglang + "/health", timeout=5, trust_env=False).status_code == 200

        undone, _ = cli(d.config_path, "undrain")
        assert undone.returncode == 0, undone.stdout + undone.stderr
        d.wait_state("ready")

        # A request far longer than router.drain_timeout: the drain gives up at the budget and
        # says so; the request is not cut (it is aborted here, by rid, to end the test).
        rid = f"drain-endless-{os.getpid()}"
        endless = pool.submit(generate, sglang, rid, int(120 / SECONDS_PER_TOKEN))
        wait_until(lambda: running_requests(sglang) > 0, 10, "the endless request running")
        began = time.monotonic()
        done, returned = cli(d.config_path, "drain", "--json")
        doc = answer(done)
        try:
            assert 1.5 <= returned - began < 10, returned - began
            assert not endless.done()
            assert doc["drain"]["idle"] is False and doc["drain"]["running"] >= 1, doc
            assert "not idle after router.drain_timeout 1.5s" in doc["drain"]["error"]
            assert d.status()["state"] == "draining"
        finally:
            httpx.post(sglang + "/abort_request", json={"rid": rid}, timeout=10, trust_env=False)
            pool.shutdown(wait=False, cancel_futures=True)
        concurrent.futures.wait([endless], timeout=30)
        assert endless.done(), "the aborted request was never answered"
        assert d.stop() == 0
