"""The stand-in's multi-node mode: rank 0 waits at --dist-init-addr for the others; a rank
>= 1 runs only schedulers and the dummy health server (always 200, no API); a dead peer makes
the survivor hang, not exit (docs/standin.md, "Multi-node mode")."""

from __future__ import annotations

import os
import signal

import httpx
import psutil
import pytest

from testkit import free_port
from testkit.standin import BOUND_LINE, Launcher


def flags(rank: int, dist: str) -> tuple[str, ...]:
    return ("--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", dist)


@pytest.mark.slow
def test_two_ranks_meet_and_a_dead_follower_makes_rank_0_hang(launch: Launcher) -> None:
    dist = f"127.0.0.1:{free_port()}"
    leader = launch(*flags(0, dist), ready=False)
    leader.wait_line("Init torch distributed begin")
    with pytest.raises(httpx.ConnectError):  # no API before the group formed
        httpx.get(f"http://127.0.0.1:{leader.port}/health", timeout=1)
    follower = launch(*flags(1, dist), ready=False)
    follower.wait_line(BOUND_LINE)
    leader.wait_ready()
    base = f"http://127.0.0.1:{follower.port}"
    for path in ("/health", "/health_generate", "/ping"):
        assert httpx.get(base + path, timeout=2).status_code == 200
    assert httpx.post(base + "/generate", json={"text": "x"}, timeout=2).status_code in (404, 405)
    kids = psutil.Process(follower.proc.pid).children()
    titles = " ".join(f"{p.name()} {' '.join(p.cmdline())}" for p in kids)
    assert "scheduler" in titles and "detokenizer" not in titles  # schedulers only
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}
    url = f"http://127.0.0.1:{leader.port}/generate"
    assert httpx.post(url, json=body, timeout=5).status_code == 200
    os.kill(follower.proc.pid, signal.SIGKILL)
    follower.wait_exit()
    # NCCL-like: the survivor neither answers nor exits.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=1.5)
    assert leader.proc.poll() is None
