"""supervisor.status in process: `kimi-serve status` against a real HTTP server on loopback."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor import status
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
    assert "Last restart: fatal_log 100 s ago (signal 9)" in text
    assert "AttributeError: 'EAGLEWorkerV2'" in text
    assert "line 39" in text and "line 14" not in text  # the last TAIL_SHOWN lines


async def run(*args: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(status.run_status_command, *args, out, err)
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
    assert "Router:" not in status.render(DOC, NOW)
