"""The admin endpoint's access rules, in process: the real aiohttp server on loopback (port 0),
a small backend standing in for the daemon, the real token file on disk."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from supervisor import admin, config
from supervisor import secret_files as admin_token
from supervisor.metrics import ADMIN_PROTECTED_ENDPOINTS
from testkit.admin import SGLANG_LINE, Backend

MUTATING = ("/restart", "/drain", "/undrain")


class Endpoint:
    def __init__(self, backend: Backend, served: admin.Served, calls: list[str]) -> None:
        self.backend = backend
        self.served = served
        self.url = f"http://127.0.0.1:{served.port}"
        self.calls = calls
        self.client = httpx.AsyncClient(base_url=self.url, trust_env=False, timeout=5)

    @property
    def token(self) -> str:
        return Path(self.backend.cfg.admin.token_file).read_text().strip()

    def bearer(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    def denied(self, endpoint: str) -> float:
        value = self.backend.metrics.registry.get_sample_value(
            "kimi_serve_admin_denied_total", {"endpoint": endpoint}
        )
        return value or 0.0


async def open_endpoint(tmp: Path, **kw: Any) -> tuple[Backend, admin.Served]:
    backend = Backend(tmp)
    served = await admin.open_endpoint(backend, "127.0.0.1", 0, **kw)
    return backend, served


@pytest.fixture
async def ep(tmp_path: Path) -> AsyncIterator[Endpoint]:
    calls: list[str] = []

    async def drain() -> dict[str, Any]:
        calls.append("drain")
        return {"drained": True, "waited_s": 0.0}

    def undrain() -> dict[str, Any]:
        calls.append("undrain")
        return {"registered": True}

    backend, served = await open_endpoint(tmp_path, on_drain=drain, on_undrain=undrain)
    endpoint = Endpoint(backend, served, calls)
    try:
        yield endpoint
    finally:
        await endpoint.client.aclose()
        await served.stop()


# ------------------------------------------------------------------------- the token file


async def test_the_token_file_is_created_0600_owned_by_the_daemon_user(ep: Endpoint) -> None:
    path = Path(ep.backend.cfg.admin.token_file)
    assert path == Path(ep.backend.cfg.state_dir) / "admin.token"
    st = path.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    token = ep.token
    assert len(token) == 43 and set(token) <= set(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    )
    # No temporary file left next to it.
    assert [p.name for p in path.parent.iterdir()] == ["admin.token"]


async def test_a_second_start_keeps_the_token(tmp_path: Path) -> None:
    _, first = await open_endpoint(tmp_path)
    token = (tmp_path / "admin.token").read_text()
    await first.stop()
    _, second = await open_endpoint(tmp_path)
    await second.stop()
    assert (tmp_path / "admin.token").read_text() == token


def test_two_tokens_are_different(tmp_path: Path) -> None:
    a = admin_token.ensure(str(tmp_path / "a"))
    b = admin_token.ensure(str(tmp_path / "b"))
    assert a.value != b.value


@pytest.mark.parametrize(
    ("spoil", "expected"),
    [
        (lambda p: p.chmod(0o644), "mode 0644"),
        (lambda p: p.chmod(0o640), "mode 0640"),
        (lambda p: os.chown(p, 65534, 65534), "owned by uid 65534"),
        (lambda p: p.write_text(""), "is empty"),
        (lambda p: p.write_text("short\n"), "does not hold a usable token"),
        (lambda p: os.link(p, p.with_name("copy")), "2 hard links"),
    ],
)
def test_an_unsafe_token_file_is_refused_not_repaired(
    tmp_path: Path, spoil: Callable[[Path], None], expected: str
) -> None:
    if expected.startswith("owned") and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    path = tmp_path / "admin.token"
    admin_token.ensure(str(path))
    spoil(path)
    before = path.lstat()
    with pytest.raises(admin_token.TokenFileError) as caught:
        admin_token.ensure(str(path))
    message = str(caught.value)
    assert str(path) in message and expected in message, message
    assert path.lstat().st_mode == before.st_mode and path.lstat().st_uid == before.st_uid


def test_a_symlink_is_checked_at_its_end(tmp_path: Path) -> None:
    real = tmp_path / "real"
    token = admin_token.ensure(str(real))
    (tmp_path / "admin.token").symlink_to(real)
    assert admin_token.ensure(str(tmp_path / "admin.token")) == token
    real.chmod(0o640)
    with pytest.raises(admin_token.TokenFileError, match="mode 0640"):
        admin_token.ensure(str(tmp_path / "admin.token"))


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(admin_token.TokenFileError, match="writable by others"):
        admin_token.ensure(str(shared / "admin.token"))
    assert list(shared.iterdir()) == []


async def test_the_token_is_never_logged(tmp_path: Path) -> None:
    with capture_logs() as logs:
        backend, served = await open_endpoint(tmp_path)
        token = Path(backend.cfg.admin.token_file).read_text().strip()
        async with httpx.AsyncClient(trust_env=False) as c:
            url = f"http://127.0.0.1:{served.port}/restart"
            await c.post(url, headers={"Authorization": f"Bearer {token}x"})
            await c.post(url, headers={"Authorization": f"Bearer {token}"})
        await served.stop()
    assert logs, "expected the admin token and denied lines"
    assert token not in repr(logs)
    assert any(
        e["event"] == "admin token" and e["file"] == str(tmp_path / "admin.token") for e in logs
    )


# ------------------------------------------------------------------- mutating endpoints


@pytest.mark.parametrize("path", MUTATING)
@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ({}, "no token"),
        ({"Authorization": "Bearer wrong-token-wrong-token-wrong-token-xx"}, "wrong token"),
        ({"Authorization": "Bearer"}, "not a bearer token"),
        ({"Authorization": "Basic a2ltaTpraW1p"}, "not a bearer token"),
    ],
)
async def test_without_the_right_token_nothing_is_done(
    ep: Endpoint, path: str, headers: dict[str, str], why: str
) -> None:
    with capture_logs() as logs:
        r = await ep.client.post(path, headers=headers)
    assert r.status_code == 401
    assert r.text.count("\n") == 1 and r.text.startswith("401: ")
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert ep.backend.restarts == 0 and ep.calls == []
    assert ep.denied(path) == 1
    (line,) = [e for e in logs if e["event"] == "admin request denied"]
    assert line["endpoint"] == path and line["peer"] == "127.0.0.1" and line["method"] == "POST"
    assert line["why"] == why
    assert ep.token not in repr(logs)


async def test_with_the_right_token_each_is_done(ep: Endpoint) -> None:
    r = await ep.client.post("/restart", headers=ep.bearer())
    assert (r.status_code, r.json()) == (202, {"accepted": True, "launch": 1})
    assert ep.backend.restarts == 1
    r = await ep.client.post("/drain", headers=ep.bearer())
    assert (r.status_code, r.json()) == (200, {"drained": True, "waited_s": 0.0})
    r = await ep.client.post("/undrain", headers=ep.bearer())
    assert (r.status_code, r.json()) == (200, {"registered": True})
    assert ep.calls == ["drain", "undrain"]
    assert all(ep.denied(p) == 0 for p in MUTATING)


async def test_drain_without_a_callback_is_501_and_refused_is_409(tmp_path: Path) -> None:
    def refuse() -> dict[str, Any]:
        raise admin.Refused("no router configured (router.url)")

    backend, served = await open_endpoint(tmp_path, on_undrain=refuse)
    token = Path(backend.cfg.admin.token_file).read_text().strip()
    auth = {"Authorization": f"Bearer {token}"}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.port}") as c:
            r = await c.post("/drain", headers=auth)
            assert r.status_code == 501 and "not supported" in r.json()["error"]
            r = await c.post("/undrain", headers=auth)
            assert r.status_code == 409 and r.json()["error"] == "no router configured (router.url)"
            # Without the token, "not supported" is not even revealed.
            assert (await c.post("/drain")).status_code == 401
    finally:
        await served.stop()


async def test_every_route_not_marked_open_needs_the_token_including_later_ones(
    tmp_path: Path,
) -> None:
    backend = Backend(tmp_path)
    path = backend.cfg.admin.token_file
    auth = admin._Auth(path, admin_token.ensure(path))
    app = admin.build_app(backend, auth)
    done: list[str] = []

    async def later(_: web.Request) -> web.Response:
        done.append("later")
        return web.Response(text="done\n")

    # Routes someone adds later, with no word about authentication.
    app.router.add_put("/later", later)
    app.router.add_delete("/later", later)
    app.router.add_get("/later-view", later)
    served = await admin.serve(app, "127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.port}") as c:
            for route in app.router.routes():
                if route.method in ("GET", "HEAD"):
                    continue
                resource = route.resource
                assert resource is not None
                r = await c.request(route.method, resource.canonical)
                assert r.status_code == 401, (route.method, resource.canonical)
            # An unmarked GET route needs the token too.
            assert (await c.get("/later-view")).status_code == 401
            # An unknown path and method: refused before routing says whether it exists.
            assert (await c.post("/nowhere")).status_code == 401
            assert (await c.patch("/metrics")).status_code == 401
            assert (await c.get("/nowhere")).status_code == 404
            token = Path(path).read_text().strip()
            r = await c.put("/later", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200
        assert done == ["later"]
        other = backend.metrics.registry.get_sample_value(
            "kimi_serve_admin_denied_total", {"endpoint": "other"}
        )
        assert other == 2
        assert (
            backend.metrics.registry.get_sample_value(
                "kimi_serve_admin_denied_total", {"endpoint": "/later-view"}
            )
            == 1
        )
    finally:
        await served.stop()


async def test_the_denied_series_exist_for_every_protected_route(ep: Endpoint) -> None:
    text = (await ep.client.get("/metrics")).text
    for endpoint in (*ADMIN_PROTECTED_ENDPOINTS, "other"):
        assert f'kimi_serve_admin_denied_total{{endpoint="{endpoint}"}} 0.0' in text
    # ... and nothing is protected that the metric does not list.
    routes = {"/status", *MUTATING, "/group", "/group/end", "/upgrade/accept", "/upgrade/rollback"}
    assert set(ADMIN_PROTECTED_ENDPOINTS) == routes


async def test_a_denial_flood_is_counted_in_full_but_logged_in_part(ep: Endpoint) -> None:
    with capture_logs() as logs:
        for _ in range(30):
            assert (await ep.client.post("/restart")).status_code == 401
    assert ep.denied("/restart") == 30
    lines = [e for e in logs if e["event"] == "admin request denied"]
    assert 1 <= len(lines) <= 10


# ----------------------------------------------------------------- read-only endpoints


async def test_probe_endpoints_ignore_tokens(ep: Endpoint) -> None:
    for headers in ({}, ep.bearer("wrong-token-wrong-token-wrong-token-xx")):
        assert (await ep.client.get("/livez", headers=headers)).status_code == 200
        assert (await ep.client.get("/readyz", headers=headers)).status_code == 503
        r = await ep.client.get("/metrics", headers=headers)
        assert r.status_code == 200 and "kimi_serve_state" in r.text
    assert all(ep.denied(p) == 0 for p in ("/livez", "/readyz", "/metrics"))


async def test_status_without_a_token_leaves_out_what_sglang_printed(ep: Endpoint) -> None:
    r = await ep.client.get("/status")
    assert r.status_code == 200
    assert "EAGLEWorkerV2" not in r.text and "Traceback" not in r.text
    doc = r.json()
    assert doc["state"] == "restarting" and doc["restarts"] == {"fatal_log": 1}
    assert doc["last_restart"]["reason"] == "fatal_log" and "log_tail" not in doc["last_restart"]
    # The contract's fields stay, so a client sees there is an error; their text does not.
    assert doc["last_probe"] == {
        "ok": False,
        "latency_s": 0.5,
        "reason": "http_status",
        "error": admin.WITHHELD,
    }
    assert doc["router"]["last_error"] == admin.WITHHELD and doc["router"]["registered"] is False
    assert doc["gpus"] == ep.backend.status_document()["gpus"]
    assert doc["events"] == [
        {
            "at": 1.0,
            "from": "ready",
            "to": "restarting",
            "reason": "fatal_log",
            "detail": admin.WITHHELD,
        }
    ]
    # SGLang's start-up lines that showed its paths: withheld; what was counted stays.
    assert doc["quality"]["evidence"] == {
        "overlap": admin.WITHHELD,
        "decode_batches_judged": 3,
        "graphs_expected": True,
    }
    assert {"log_tail", "error", "last_error", "evidence"} <= set(doc["redacted"])


async def test_status_with_the_token_is_whole(ep: Endpoint) -> None:
    r = await ep.client.get("/status", headers=ep.bearer())
    assert r.status_code == 200
    assert r.json() == ep.backend.status_document()


async def test_status_with_a_wrong_token_is_401(ep: Endpoint) -> None:
    r = await ep.client.get("/status", headers=ep.bearer("wrong-token-wrong-token-wrong-token-x"))
    assert r.status_code == 401 and "EAGLEWorkerV2" not in r.text
    assert ep.denied("/status") == 1


# ------------------------------------------------------------------ rotation, fail closed


async def test_a_replaced_token_file_takes_effect_without_a_restart(ep: Endpoint) -> None:
    old = ep.token
    path = Path(ep.backend.cfg.admin.token_file)
    path.unlink()
    admin_token.ensure(str(path))
    new = ep.token
    assert new != old
    assert (await ep.client.post("/restart", headers=ep.bearer(old))).status_code == 401
    assert (await ep.client.post("/restart", headers=ep.bearer(new))).status_code == 202


async def test_a_token_file_made_readable_while_running_fails_closed(ep: Endpoint) -> None:
    token = ep.token
    path = Path(ep.backend.cfg.admin.token_file)
    path.chmod(0o644)
    with capture_logs() as logs:
        r = await ep.client.post("/restart", headers=ep.bearer(token))
    assert r.status_code == 401 and ep.backend.restarts == 0
    assert any(e["event"] == "admin token file unusable; refusing" for e in logs)
    denied = next(e for e in logs if e["event"] == "admin request denied")
    assert denied["why"] == "token file unusable"
    path.chmod(0o600)
    assert (await ep.client.post("/restart", headers=ep.bearer(token))).status_code == 202


# --------------------------------------------------------------------------- bad input


async def test_an_oversized_body_is_413_and_nothing_is_done(ep: Endpoint) -> None:
    body = b"x" * (admin.Limits().max_body_bytes + 1)
    r = await ep.client.post("/restart", headers=ep.bearer(), content=body)
    assert r.status_code == 413 and ep.backend.restarts == 0
    assert (await ep.client.get("/livez")).status_code == 200


async def cut(reader: asyncio.StreamReader, within: float = 1.0) -> bool:
    """Whether the server closed this connection (an abort may arrive as a reset)."""
    try:
        return await asyncio.wait_for(reader.read(), within) == b""
    except ConnectionResetError:
        return True


async def raw_request(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"POST /restart HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"GET /status HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"a" * 9000 + b"\r\n\r\n",
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",
        b"GET /status HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(100)) + b"\r\n",
        b"POST /restart HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
)
async def test_malformed_requests_get_4xx_and_do_nothing(
    ep: Endpoint, request_bytes: bytes
) -> None:
    answer = await raw_request(ep.served.port, request_bytes)
    assert re.match(rb"HTTP/1\.[01] 4\d\d ", answer), answer[:200]
    assert ep.backend.restarts == 0
    assert (await ep.client.get("/livez")).status_code == 200


async def test_slow_clients_are_cut_off_and_others_are_served(tmp_path: Path) -> None:
    limits = admin.Limits(request_timeout_s=1.0)
    _, served = await open_endpoint(tmp_path, limits=limits)
    loop = asyncio.get_running_loop()
    try:
        # A slowloris client: one header byte every 0.2 s, never finishing the head.
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        started = loop.time()
        writer.write(b"GET /status HTTP/1.1\r\nHost: x\r\n")

        async def trickle() -> None:
            while True:
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.2)

        dripping = asyncio.create_task(trickle())
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.port}") as c:
            while not reader.at_eof() and loop.time() - started < 5:
                assert (await c.get("/livez")).status_code == 200
                await asyncio.sleep(0.1)
        assert await asyncio.wait_for(reader.read(), 1) == b""
        cut_after = loop.time() - started
        dripping.cancel()
        writer.close()
        assert 0.9 <= cut_after < 3.0, cut_after
    finally:
        await served.stop()


async def test_at_the_connection_limit_idle_connections_make_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admin, "FRESH_S", 0.0)  # the hoard counts as idle at once
    limits = admin.Limits(max_connections=8, reserve_connections=0)
    _, served = await open_endpoint(tmp_path, limits=limits)
    try:
        hoard = [await asyncio.open_connection("127.0.0.1", served.port) for _ in range(8)]
        while served.gate.open < 8:
            await asyncio.sleep(0.01)
        answer = await raw_request(
            served.port, b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert served.gate.evicted == 1 and served.gate.refused == 0
        # The oldest hoarded connection is the one that was closed.
        reader, _ = hoard[0]
        assert await cut(reader)
        for _, writer in hoard:
            writer.close()
    finally:
        await served.stop()


async def test_at_the_connection_limit_fresh_connections_are_kept_for_a_while(
    tmp_path: Path,
) -> None:
    """Connections that have sent nothing yet are never the ones cut at once (a probe may be
    among them, its request not read yet): the newcomer is let in over the limit, up to
    twice it, and the sweep trims back once they are no longer fresh."""
    limits = admin.Limits(max_connections=2, reserve_connections=0)
    _, served = await open_endpoint(tmp_path, limits=limits)
    try:
        conns = [await asyncio.open_connection("127.0.0.1", served.port) for _ in range(4)]
        while served.gate.open < 4:
            await asyncio.sleep(0.01)
        assert (served.gate.evicted, served.gate.refused) == (0, 0)
        answer = await raw_request(served.port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503"), answer  # twice the limit: refused
        # Once no longer fresh, the sweep closes the oldest until the limit holds again.
        assert await cut(conns[0][0], 5) and await cut(conns[1][0], 5)
        assert served.gate.open == 2 and served.gate.evicted == 2
        for _, w in conns:
            w.close()
    finally:
        await served.stop()


async def test_at_the_connection_limit_the_longest_waiting_trickler_makes_room(
    tmp_path: Path,
) -> None:
    """Slow clients that never pause long enough to look idle: a byte every 0.1 s each."""
    limits = admin.Limits(max_connections=4, reserve_connections=0)
    _, served = await open_endpoint(tmp_path, limits=limits)
    stop = asyncio.Event()
    conns = []

    async def trickle(writer: asyncio.StreamWriter) -> None:
        writer.write(b"GET /status HTTP/1.1\r\nHost: x\r\n")
        while not stop.is_set():
            writer.write(b"X")
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            await asyncio.sleep(0.1)

    try:
        for _ in range(4):
            conns.append(await asyncio.open_connection("127.0.0.1", served.port))
        while served.gate.open < 4:
            await asyncio.sleep(0.01)
        tricklers = [asyncio.create_task(trickle(w)) for _, w in conns]
        livez = b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        answer = await raw_request(served.port, livez)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert (served.gate.evicted, served.gate.refused) == (1, 0)
        assert await cut(conns[0][0])
        # A new trickler takes the free slot; the next newcomer again ends the oldest one.
        conns.append(await asyncio.open_connection("127.0.0.1", served.port))
        tricklers.append(asyncio.create_task(trickle(conns[-1][1])))
        while served.gate.open < 4:
            await asyncio.sleep(0.01)
        answer = await raw_request(served.port, livez)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert (served.gate.evicted, served.gate.refused) == (2, 0)
        assert await cut(conns[1][0])
        assert not any(r.at_eof() for r, _ in conns[2:])
        stop.set()
        await asyncio.gather(*tricklers)
    finally:
        for _, w in conns:
            w.close()
        await served.stop()


async def test_a_trickled_head_is_cut_at_the_deadline_without_pressure(tmp_path: Path) -> None:
    """The gate's own deadline, whatever aiohttp's timers do: request_timeout_s for a head."""
    limits = admin.Limits(request_timeout_s=1.0)
    _, served = await open_endpoint(tmp_path, limits=limits)
    loop = asyncio.get_running_loop()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        started = loop.time()
        writer.write(b"GET /status HTTP/1.1\r\nHost: x\r\n")
        for _ in range(100):
            if reader.at_eof():
                break
            writer.write(b"X")
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.1)
        cut_after = loop.time() - started
        assert reader.at_eof() and 0.9 <= cut_after < 3.0, cut_after
        assert served.gate.open == 0
        writer.close()
    finally:
        await served.stop()


async def test_at_the_connection_limit_busy_connections_are_kept_and_newcomers_get_503(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admin, "FRESH_S", 0.0)  # the reserve's idle client counts as idle
    release = asyncio.Event()
    started: list[int] = []

    async def drain() -> dict[str, Any]:
        started.append(1)
        await release.wait()
        return {"drained": True}

    limits = admin.Limits(max_connections=4, reserve_connections=1)
    backend, served = await open_endpoint(tmp_path, on_drain=drain, limits=limits)
    token = Path(backend.cfg.admin.token_file).read_text().strip()
    request = (
        f"POST /drain HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        "Connection: close\r\nContent-Length: 0\r\n\r\n"
    ).encode()
    try:
        drains = [asyncio.create_task(raw_request(served.port, request)) for _ in range(4)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while len(started) < 4 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert len(started) == 4
        # The reserve: one more loopback client, kept while it waits for its answer.
        probe_reader, probe_writer = await asyncio.open_connection("127.0.0.1", served.port)
        while served.gate.open < 5:
            await asyncio.sleep(0.01)
        # Requests in progress are never taken for a slow client; nor is the reserve's.
        livez = b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        answer = await raw_request(served.port, livez)
        assert (served.gate.refused, served.gate.evicted) == (0, 1)  # the idle reserve one
        assert await cut(probe_reader)
        probe_writer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer
        drains.append(asyncio.create_task(raw_request(served.port, request)))
        while len(started) < 5:
            await asyncio.sleep(0.01)
        answer = await raw_request(served.port, livez)
        assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
        assert (served.gate.refused, served.gate.evicted) == (1, 1)
        release.set()
        for answer in await asyncio.gather(*drains):
            assert answer.startswith(b"HTTP/1.1 200"), answer
    finally:
        await served.stop()


# ------------------------------------------------------------------------------- config


def test_the_default_token_file_is_in_the_state_directory() -> None:
    cfg = config.parse("sglang: {model_path: /m}\nstate_dir: /srv/k\n", "t.yaml")
    assert cfg.admin.token_file == "/srv/k/admin.token" and cfg.admin.allow_remote is False
    cfg = config.parse(
        "sglang: {model_path: /m}\nadmin: {token_file: /etc/kimi-serve/admin.token}\n", "t.yaml"
    )
    assert cfg.admin.token_file == "/etc/kimi-serve/admin.token"


def test_a_relative_token_file_is_a_config_error() -> None:
    with pytest.raises(config.ConfigError) as caught:
        config.parse("sglang: {model_path: /m}\nadmin:\n  token_file: admin.token\n", "t.yaml")
    assert "t.yaml:3: admin.token_file: 'admin.token' is not an absolute path" in str(caught.value)


@pytest.mark.parametrize(
    "listen", ["0.0.0.0:29400", "10.0.0.5:29400", "[::]:29400", "gpu-host-7:29400"]
)
def test_a_non_loopback_listen_needs_allow_remote(listen: str) -> None:
    text = f"sglang: {{model_path: /m}}\nadmin:\n  listen: '{listen}'\n"
    with pytest.raises(config.ConfigError) as caught:
        config.parse(text, "t.yaml")
    message = str(caught.value)
    assert message.startswith("t.yaml:3: admin.listen: ") and "admin.allow_remote" in message
    cfg = config.parse(text + "  allow_remote: true\n", "t.yaml")
    assert cfg.admin.allow_remote is True


@pytest.mark.parametrize(
    "listen", ["127.0.0.1:29400", "127.0.0.2:1", "[::1]:29400", "localhost:29400"]
)
def test_loopback_listen_needs_nothing(listen: str) -> None:
    cfg = config.parse(f"sglang: {{model_path: /m}}\nadmin: {{listen: '{listen}'}}\n", "t.yaml")
    assert cfg.admin.allow_remote is False


# ------------------------------------------------------------------- the status summary


def test_the_summary_says_what_a_tokenless_status_left_out(tmp_path: Path) -> None:
    from supervisor.admin import status_command as status

    whole = Backend(tmp_path).status_document()
    shown = status.render(whole, now=2.0)
    assert SGLANG_LINE in shown and "admin token" not in shown
    redacted = admin.redact(whole)
    redacted["redacted"] = sorted(admin.SGLANG_TEXT_KEYS)
    shown = status.render(redacted, now=2.0)
    assert SGLANG_LINE not in shown and "Last restart: fatal_log" in shown
    assert "shown with the admin token" in shown


def test_the_canarys_answers_are_left_out_without_the_token() -> None:
    """The canary's expected and received texts are what the model generated: SGLang's text,
    shown only with the token; the intent check's `expected` (a config value) stays."""
    doc = {
        "quality": {
            "canary": {"state": "mismatch", "at": 5.0, "expected": "Paris", "got": "Lyon"},
            "degraded": ["canary_mismatch"],
        },
        "intent": {"mismatches": [{"arg": "tp_size", "expected": 8, "actual": 4}]},
    }
    shown = admin.redact(doc)
    assert shown["quality"]["canary"] == {"state": "mismatch", "at": 5.0}
    assert shown["quality"]["degraded"] == ["canary_mismatch"]
    assert shown["intent"]["mismatches"] == [{"arg": "tp_size", "expected": 8, "actual": 4}]


def test_empty_text_is_not_shown_as_withheld_and_evidence_is_withheld_at_any_depth() -> None:
    doc = {
        "state": "ready",
        "detail": "",
        "status_line": "ready (primary)",
        "last_probe": {"ok": True, "error": None},
        "events": [{"from": "warming", "to": "ready", "reason": "probe_ok", "detail": ""}],
        "quality": {
            "evidence": {
                "overlap": "overlap scheduler on",
                "more": ["spec v2 line", {"graph": "Capture cuda graph end"}],
                "decode_batches_judged": 4,
                "graphs_expected": True,
            }
        },
    }
    shown = admin.redact(doc)
    assert shown["detail"] == "" and shown["events"][0]["detail"] == ""
    assert shown["last_probe"] == {"ok": True, "error": None}
    assert shown["status_line"] == admin.WITHHELD
    assert shown["quality"]["evidence"] == {
        "overlap": admin.WITHHELD,
        "more": [admin.WITHHELD, {"graph": admin.WITHHELD}],
        "decode_batches_judged": 4,
        "graphs_expected": True,
    }
