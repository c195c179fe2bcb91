"""supervisor.admin in process: the real aiohttp app on loopback, a fake backend behind it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CONTENT_TYPE_LATEST

from supervisor import admin


@dataclass
class Backend:
    state: str = "loading"
    healthy: bool = True
    refuse: str | None = None
    restarts: int = 0
    doc: dict[str, Any] = field(default_factory=dict)

    def status_document(self) -> dict[str, Any]:
        return {"state": self.state, **self.doc}

    def is_ready(self) -> bool:
        return self.state in ("ready", "degraded")

    def loop_healthy(self) -> bool:
        return self.healthy

    def render_metrics(self) -> bytes:
        return b"kimi_serve_ready 0.0\n"

    def request_restart(self) -> str | None:
        if self.refuse is None:
            self.restarts += 1
        return self.refuse


@pytest.fixture
async def served() -> AsyncIterator[tuple[Backend, httpx.AsyncClient]]:
    backend = Backend()
    server = TestServer(admin.build_app(backend), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{server.port}", trust_env=False
        ) as client:
            yield backend, client
    finally:
        await server.close()


async def test_readyz_follows_readiness_and_names_the_state(
    served: tuple[Backend, httpx.AsyncClient],
) -> None:
    backend, client = served
    r = await client.get("/readyz")
    assert (r.status_code, r.text) == (503, "loading\n")
    backend.state = "degraded"
    r = await client.get("/readyz")
    assert (r.status_code, r.text) == (200, "degraded\n")


async def test_livez_is_the_loop_heartbeat(served: tuple[Backend, httpx.AsyncClient]) -> None:
    backend, client = served
    assert (await client.get("/livez")).status_code == 200
    backend.healthy = False
    r = await client.get("/livez")
    assert (r.status_code, r.text) == (503, "stalled\n")


async def test_status_is_the_backend_document_as_json(
    served: tuple[Backend, httpx.AsyncClient],
) -> None:
    backend, client = served
    backend.doc = {"restarts": {"exited": 2}, "since": 1.5}
    assert (await client.get("/status")).json() == {
        "state": "loading",
        "restarts": {"exited": 2},
        "since": 1.5,
    }


async def test_restart_is_accepted_or_refused_with_the_reason(
    served: tuple[Backend, httpx.AsyncClient],
) -> None:
    backend, client = served
    r = await client.post("/restart")
    assert (r.status_code, r.json()) == (202, {"accepted": True})
    assert backend.restarts == 1
    backend.refuse = "the daemon is stopping"
    r = await client.post("/restart")
    assert r.status_code == 409
    assert r.json() == {"accepted": False, "error": "the daemon is stopping"}
    assert backend.restarts == 1
    assert (await client.get("/restart")).status_code == 405


async def test_metrics_are_the_prometheus_text_format(
    served: tuple[Backend, httpx.AsyncClient],
) -> None:
    _, client = served
    r = await client.get("/metrics")
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    assert r.text == "kimi_serve_ready 0.0\n"
