"""supervisor.admin.status_command in process:
`kimi-serve status` against a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor import admin, config, router
from supervisor.admin import status_command as status
from supervisor.metrics import Metrics
from testkit import free_port

NOW = 1_700_000_000.0
DOC: dict[str, Any] = {
    "state": "warming",
    "since": NOW - 30,
    "detail": "",
    "profile": "primary",
    "version": "1.0",
    "sglang_version": "0.5.23",
    "child": {"pid": 4242, "started_at": NOW - 90, "launch": 2, "processes": [4242, 4243]},
    "restarts": {"fatal_log": 1, "exited": 2},
    "last_restart": {
        "reason": "fatal_log",
        "at": NOW - 100,
        "exit_code": None,
        "signal": 9,
        "detail": "AttributeError: 'EAGLEWorkerV2' object has no attribute 'x'",
        "log_tail": [f"line {i}" for i in range(40)],
    },
    "last_probe": None,
    "intent": {"mismatches": [{"arg": "tp_size", "expected": 8, "actual": 4}]},
    "gpus": [],
    "events": [],
}


@pytest.fixture
async def daemon_url() -> AsyncIterator[dict[str, Any]]:
    served: dict[str, Any] = {"doc": DOC}

    async def handler(_: web.Request) -> web.Response:
        return web.json_response(served["doc"])

    app = web.Application()
    app.router.add_get("/status", handler)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    served["url"] = f"http://127.0.0.1:{server.port}"
    try:
        yield served
    finally:
        await server.close()


def test_render_says_what_on_call_needs() -> None:
    text = status.render(DOC, NOW)
    assert "State: warming since" in text and "30 s ago" in text
    assert "SGLang: pid 4242, up 90 s (2 processes)" in text
    assert "Restarts: 3 (exited 2, fatal_log 1)" in text
    assert "MISMATCH: tp_size: configured 8, server runs 4" in text
    assert "Last restart: fatal_log 100 s ago (stopped by kimi-serve: fatal_log, signal 9)" in text
    assert "AttributeError: 'EAGLEWorkerV2'" in text
    assert "line 39" in text and "line 14" not in text  # the last TAIL_SHOWN lines


async def run(*args: Any, token: str | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(status.run_status_command, *args, out, err, token)
    return code, out.getvalue(), err.getvalue()


async def test_not_ready_is_exit_3_and_ready_is_0(daemon_url: dict[str, Any]) -> None:
    code, out, _ = await run(daemon_url["url"], False)
    assert code == status.EX_NOT_READY and "warming" in out
    daemon_url["doc"] = {**DOC, "state": "ready"}
    code, out, _ = await run(daemon_url["url"], True)
    assert code == status.EX_READY
    assert json.loads(out)["state"] == "ready"


async def test_an_unreachable_daemon_is_exit_4_with_advice() -> None:
    code, out, err = await run(f"http://127.0.0.1:{free_port()}", False)
    assert code == status.EX_UNREACHABLE and out == ""
    assert "cannot reach the daemon" in err and "systemctl status kimi-serve" in err


async def test_a_document_that_is_not_an_object_is_unreachable(
    daemon_url: dict[str, Any],
) -> None:
    daemon_url["doc"] = ["not", "an", "object"]
    code, _, err = await run(daemon_url["url"], False)
    assert code == status.EX_UNREACHABLE and "not a JSON object" in err


def test_render_counts_the_leftovers_of_the_last_cleaning() -> None:
    doc = {**DOC, "leftovers": {"killed": {"0": 1, "1": 1, "none": 2}, "processes": []}}
    text = status.render(doc, NOW)
    assert " Leftovers: 4 killed before the last launch (GPU 0: 1, GPU 1: 1, no GPU memory: 2)" in (
        text
    )
    quiet = status.render({**DOC, "leftovers": {"killed": {}, "processes": []}}, NOW)
    assert "Leftovers" not in quiet


ROUTER = {
    "url": "http://10.0.0.5:30080",
    "worker_url": "http://10.0.0.7:30000",
    "registered": True,
    "worker_id": "0c1d",
    "wanted": True,
    "last_error": None,
    "last_error_at": None,
    "last_ok_at": NOW - 2,
    "last_drain": None,
}


def test_render_shows_the_router_registration() -> None:
    text = status.render({**DOC, "router": ROUTER}, NOW)
    assert (
        "    Router: http://10.0.0.5:30080 as http://10.0.0.7:30000, registered (worker 0c1d)"
        in text.splitlines()
    )
    assert "last error" not in text
    failing = {
        **ROUTER,
        "registered": False,
        "worker_id": None,
        "last_error": "register: POST http://10.0.0.5:30080/workers: cannot connect (refused)",
        "last_error_at": NOW - 12,
    }
    lines = status.render({**DOC, "router": failing}, NOW).splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("    Router: "))
    assert "NOT REGISTERED (wanted" in lines[i]
    assert lines[i + 1] == (
        "            last error 12 s ago: register: POST http://10.0.0.5:30080/workers: "
        "cannot connect (refused)"
    )
    out = status.render({**DOC, "router": {**ROUTER, "registered": False, "wanted": False}}, NOW)
    assert "not registered (not ready)" in out
    assert "Router:" not in status.render({**DOC, "router": None}, NOW)
    assert "Router:" not in status.render({**DOC, "router": router.unlinked_status()}, NOW)
    assert "Router:" not in status.render(DOC, NOW)


class _Backend:
    """What the daemon offers the admin endpoint: a document holding SGLang's text."""

    def __init__(self, tmp: Path, state: str) -> None:
        self.cfg = config.parse(
            f"sglang: {{model_path: /m}}\ngpus: {{manage: false}}\nstate_dir: {tmp}\n", "t.yaml"
        )
        self.metrics = Metrics()
        self.state = state

    def status_document(self) -> dict[str, Any]:
        return {**DOC, "state": self.state}

    def is_ready(self) -> bool:
        return self.state == "ready"

    def loop_healthy(self) -> bool:
        return True

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def request_restart(self) -> str | None:
        return None

    def next_launch(self) -> int:
        return 2


@pytest.mark.parametrize(("state", "code"), [("ready", 0), ("warming", 3)])
async def test_a_rejected_token_falls_back_to_the_open_status(
    tmp_path: Path, state: str, code: int
) -> None:
    """The real admin endpoint with its real token file: a well-formed token it refuses (a
    stale copy, a token of another host) still gives the state and its exit code, not 4."""
    backend = _Backend(tmp_path, state)
    served = await admin.open_endpoint(backend, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{served.port}"
    try:
        real = Path(backend.cfg.admin.token_file).read_text().strip()
        got, out, err = await run(url, False, token="0" * len(real))
        assert got == code, err
        assert "refused the admin token" in err and "SGLang's text left out" in err
        assert f"State: {state} since" in out
        assert "EAGLEWorkerV2" not in out  # the open document: SGLang's text withheld
        assert "shown with the admin token" in out
        got, out, err = await run(url, True, token="0" * len(real))
        assert got == code and json.loads(out)["state"] == state
        # The right token: the whole document, nothing said on stderr.
        got, out, err = await run(url, False, token=real)
        assert (got, err) == (code, "")
        assert "EAGLEWorkerV2" in out and "line 39" in out
    finally:
        await served.stop()


def test_render_shows_how_often_an_event_repeated() -> None:
    events = [
        {"at": NOW - 60, "from": "starting", "to": "cleaning", "reason": "started", "count": 1},
        {
            "at": NOW - 59,
            "from": "cleaning",
            "to": "cleaning",
            "reason": "host_not_ready",
            "detail": "sglang.port 30000 is in use",
            "count": 118,
            "last_at": NOW,
        },
    ]
    lines = status.render({**DOC, "events": events}, NOW).splitlines()
    last = time.strftime("%H:%M:%S", time.localtime(NOW))
    assert lines[-1].endswith(
        f"cleaning -> cleaning (host_not_ready) - sglang.port 30000 is in use (x118, last {last})"
    )
    assert lines[-2].endswith("starting -> cleaning (started)")


def test_quality_line() -> None:
    from supervisor.admin.status_command import quality_line

    ok = {
        "canary": {"state": "matched"},
        "decode_tokens_per_second": 88.04,
        "spec_accept_length": 2.714,
        "degraded": [],
    }
    assert quality_line(ok) == "canary matched, decode 88.0 tokens/s, accept length 2.71, ok"
    bad = {
        "canary": {"state": "mismatch", "expected": "a b", "got": "c d"},
        "decode_tokens_per_second": None,
        "spec_accept_length": None,
        "degraded": ["canary_mismatch", "slow_decode"],
    }
    line = quality_line(bad)
    assert line == (
        "canary MISMATCH (expected 'a b', got 'c d'), DEGRADED: canary_mismatch, slow_decode"
    )
    assert quality_line(None) == "" and quality_line({"canary": 3}).startswith("canary ?")


async def test_an_answer_that_is_not_a_status_is_unreachable_not_a_traceback(
    tmp_path: Path,
) -> None:
    """A server on the admin address answering JSON of the wrong shape (`since` a string, a
    list for `restarts`): one line on stderr and the contract's 4; --json still shows it."""

    class Odd(_Backend):
        def status_document(self) -> dict[str, Any]:
            return {**DOC, "state": "ready", "since": "yesterday", "restarts": [1, 2]}

    backend = Odd(tmp_path, "ready")
    served = await admin.open_endpoint(backend, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{served.port}"
    try:
        real = Path(backend.cfg.admin.token_file).read_text().strip()
        got, out, err = await run(url, False, token=real)
        assert got == 4 and out == "" and err.count("\n") == 1
        assert "is not a kimi-serve status" in err and "Traceback" not in err
        got, out, _ = await run(url, True, token=real)
        assert got == 0 and json.loads(out)["since"] == "yesterday"
    finally:
        await served.stop()


def test_a_launch_kimi_serve_stopped_says_so_and_one_that_died_says_how() -> None:
    from supervisor.core.states import how_it_ended
    from supervisor.incidents.recorder import _ended

    assert how_it_ended("canary_mismatch", ["signal 9"]) == (
        " (stopped by kimi-serve: canary_mismatch, signal 9)"
    )
    assert how_it_ended("liveness_failed", []) == " (stopped by kimi-serve: liveness_failed)"
    assert how_it_ended("exited", ["exit code 1"]) == " (died: exit code 1)"
    assert how_it_ended("manual", ["exit code 0"]) == " (stopped as asked: exit code 0)"
    # The incident's reason for no stacks: nothing died under a canary mismatch.
    assert "died" not in _ended("canary_mismatch")
    assert "kimi-serve stopped a running SGLang (canary_mismatch)" in _ended("canary_mismatch")
    assert "SGLang or one of its workers died" in _ended("exited")
