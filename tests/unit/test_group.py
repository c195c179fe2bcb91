"""supervisor/daemon/group.py and what it decides with: `group.leader` (one file for every node of a
LeaderWorkerSet), a follower in `failed` ending the leader's epoch, kimi_serve_ready following
/readyz, a reload that would change the group's shape refused, and the poll's bound on what a
peer may send, against real misbehaving HTTP servers on loopback."""

from __future__ import annotations

import asyncio
import gzip
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from structlog.testing import capture_logs

from supervisor import config
from supervisor import secret_files as admin_token
from supervisor.config import Config, ConfigError
from supervisor.core.machine import (
    Machine,
    PeerView,
    State,
    Verdict,
    follower_failed_ends,
    leader_ends,
)
from supervisor.daemon import reload
from supervisor.daemon.group import MAX_ANSWER_BYTES, Group, reload_refusal
from supervisor.metrics import Metrics

LEADER_ADDR = "kimi-serve-0.kimi-serve.default"


def group_cfg(rank: int, group: str, state_dir: Path | None = None) -> Config:
    text = (
        "sglang:\n  model_path: /m\n  port: 30000\n"
        f"  args: {{nnodes: 2, node-rank: {rank}, dist-init-addr: '10.0.0.1:5000'}}\n"
        f"group: {group}\n"
    )
    if state_dir is not None:
        text += f"state_dir: {state_dir}\n"
    return config.parse(text, "c.yaml")


# ------------------------------------------------------------------ group.leader


def test_group_leader_fills_a_follower_s_peers_and_the_leader_only_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LWS_LEADER_ADDRESS", LEADER_ADDR)
    one_file = "{leader: 'http://${LWS_LEADER_ADDRESS}:29400'}"
    follower, leader = group_cfg(1, one_file), group_cfg(0, one_file)
    assert follower.group.peers == (f"http://{LEADER_ADDR}:29400",)
    assert follower.group.coordinated and follower.group.answers
    assert leader.group.peers == () and not leader.group.coordinated
    assert leader.group.answers  # serves GET /group for its followers
    # ${NAME} works in group.peers too.
    monkeypatch.setenv("PEER", "10.0.0.2")
    assert group_cfg(0, "{peers: ['http://${PEER}:29400']}").group.peers == (
        "http://10.0.0.2:29400",
    )


@pytest.mark.parametrize(
    ("rank", "group", "path", "words"),
    [
        (1, "{leader: 'http://${NOT_SET_ANYWHERE}:1'}", "group.leader", "NOT_SET_ANYWHERE"),
        (1, "{leader: 'http://a:1', peers: ['http://b:1']}", "group.leader", "differs"),
        (0, "{leader: 'ftp://a'}", "group.leader", "not an http"),
    ],
)
def test_a_bad_group_leader_names_the_key(rank: int, group: str, path: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        group_cfg(rank, group)
    issue = next(i for i in err.value.issues if i.path == path)
    assert words in issue.message and issue.line is not None


def test_group_leader_on_one_node_is_an_error() -> None:
    with pytest.raises(ConfigError) as err:
        config.parse("sglang: {model_path: /m}\ngroup: {leader: 'http://a:1'}\n", "c.yaml")
    assert "group.leader" in {i.path for i in err.value.issues}


# ------------------------------------------------------------------ a follower in failed

E = "n-1"
FAILED = PeerView(None, "failed", running=False, ready=False)


@pytest.mark.parametrize("joined", [False, True])
def test_a_failed_follower_ends_the_leader_s_epoch_joined_or_not(joined: bool) -> None:
    why = leader_ends(E, State.LOADING, FAILED, joined, 0.0, 10.0)
    assert why is not None and "follower failed" in why
    assert leader_ends(E, State.RESTARTING, FAILED, joined, 0.0, 10.0) is None


@pytest.mark.parametrize(
    ("state", "leader", "told", "ends"),
    [
        (State.FAILED, PeerView(E, "loading", True, False), None, E),
        (State.FAILED, PeerView(E, "loading", True, False), E, None),  # once per epoch
        (State.FAILED, PeerView("n-2", "loading", True, False), E, "n-2"),  # the next one
        (State.FAILED, PeerView(E, "restarting", False, False), None, None),  # already ending
        (State.FAILED, PeerView(None, "cleaning", False, False), None, None),
        (State.FAILED, None, None, None),  # no answer: nothing to end
        (State.CLEANING, PeerView(E, "loading", True, False), None, None),
    ],
)
def test_follower_failed_ends(
    state: State, leader: PeerView | None, told: str | None, ends: str | None
) -> None:
    assert follower_failed_ends(state, leader, told) == ends


# ------------------------------------------------------------------ kimi_serve_ready


def ready_gauge(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("kimi_serve_ready")


def test_kimi_serve_ready_on_a_follower_follows_the_leader_gated_readyz(tmp_path: Path) -> None:
    cfg = group_cfg(1, "{peers: ['http://10.0.0.1:29400']}", tmp_path)
    machine = Machine(cfg, 0.0)
    metrics = Metrics()
    g = Group(cfg, machine.ctx, httpx.AsyncClient(), lambda _: None, lambda: 0.0, metrics)
    machine.ctx.state = State.READY
    metrics.set_state(State.READY, 0.0)  # what the daemon does on the transition: ignored
    assert g.ready() is False and ready_gauge(metrics) == 0.0
    g.joined = E
    g.peers[0].view = PeerView(E, "ready", running=True, ready=True)
    assert g.ready() is True and ready_gauge(metrics) == 1.0
    g.peers[0].view = PeerView(E, "degraded", running=True, ready=False)
    assert ready_gauge(metrics) == 0.0
    g.peers[0].view = None  # the leader does not answer
    assert ready_gauge(metrics) == 0.0


# ------------------------------------------------------------------ reload


def test_a_reload_changing_the_role_or_the_peers_is_refused_with_one_line() -> None:
    running = group_cfg(1, "{peers: ['http://10.0.0.1:29400']}")
    rank = group_cfg(0, "{peers: ['http://10.0.0.2:29400']}")
    peers = group_cfg(1, "{peers: ['http://10.0.0.9:29400']}")
    timing = group_cfg(1, "{peers: ['http://10.0.0.1:29400'], poll_interval: 2s}")
    assert "node rank 1 of 2 -> leader, node rank 0 of 2" in (reload_refusal(running, rank) or "")
    assert "group.peers changed" in (reload_refusal(running, peers) or "")
    assert reload_refusal(running, timing) is None
    heard: list[str | None] = []
    with capture_logs() as logs:
        assert reload.judge(running, rank, heard.append) is Verdict.INVALID
    (line,) = [e for e in logs if e["log_level"] == "error"]
    assert line["event"] == "reload refused: keeping the running configuration"
    assert "next start of the daemon" in line["why"] and heard == [line["why"]]
    assert reload.judge(running, timing, heard.append) is Verdict.CHANGED
    assert heard[-1] is None  # a reload that is taken clears /status.reload_refused
    from supervisor.admin.status_command import render

    text = render({"state": "ready", "reload_refused": line["why"]}, 0.0)
    assert f"Reload: REFUSED: {line['why']}" in text
    assert "Reload" not in render({"state": "ready", "reload_refused": None}, 0.0)


# ------------------------------------------------------------------ a misbehaving peer

GOOD = b'{"epoch": "n-1", "state": "loading", "running": true, "ready": false}'


class Peer:
    """A real HTTP server on loopback that answers GET /group as `mode` says."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sent = 0
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None
        # Made before the poll: the poll's allocations are what is measured.
        self.bomb = gzip.compress(b" " * 64 * 2**20) if mode == "gzip" else b""

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _send(self, w: asyncio.StreamWriter, data: bytes) -> None:
        w.write(data)
        await w.drain()
        self.sent += len(data)

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await r.readuntil(b"\r\n\r\n")
            ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            if self.mode == "good":
                await self._send(w, ok + b"Content-Length: %d\r\n\r\n" % len(GOOD) + GOOD)
            elif self.mode == "huge":  # 64 MiB, no length declared
                await self._send(w, ok + b"Connection: close\r\n\r\n")
                for _ in range(1024):
                    await self._send(w, b" " * 65536)
            elif self.mode == "declared":  # a 1 GB Content-Length, then a slow body
                await self._send(w, ok + b"Content-Length: 1000000000\r\n\r\n")
                while True:
                    await self._send(w, b" " * 1024)
                    await asyncio.sleep(0.01)
            elif self.mode == "trickle":  # one byte every 50 ms: no read timeout ever fires
                await self._send(w, ok + b"Content-Length: 1000\r\n\r\n")
                while True:
                    await self._send(w, b" ")
                    await asyncio.sleep(0.05)
            elif self.mode == "gzip":  # 16 KiB of gzip that inflates to 64 MiB
                head = b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(self.bomb)
                await self._send(w, ok + head + self.bomb)
            await r.read()  # until the client goes
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed_by_client.set()
            w.close()


@pytest.fixture
async def peer_server() -> AsyncIterator[Callable[[str], Awaitable[Peer]]]:
    servers: list[asyncio.Server] = []

    async def start(mode: str) -> Peer:
        peer = Peer(mode)
        peer.server = await asyncio.start_server(peer.handle, "127.0.0.1", 0)
        servers.append(peer.server)
        return peer

    yield start
    for s in servers:
        s.close()


async def poll(tmp_path: Path, peer: Peer) -> tuple[Group, float, int]:
    """One poll of `peer` by a follower; (the group, seconds it took, peak bytes allocated)."""
    cfg = group_cfg(1, f"{{peers: ['{peer.url}'], poll_timeout: 1s}}", tmp_path)
    admin_token.ensure(cfg.group.token_file)
    async with httpx.AsyncClient(trust_env=False) as http:
        g = Group(cfg, Machine(cfg, 0.0).ctx, http, lambda _: None, time.monotonic, Metrics())
        tracemalloc.start()
        t0 = time.monotonic()
        try:
            await g.poll_once()
            elapsed = time.monotonic() - t0
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    return g, elapsed, peak


async def test_a_well_behaved_peer_is_read(
    tmp_path: Path, peer_server: Callable[[str], Awaitable[Peer]]
) -> None:
    g, _, _ = await poll(tmp_path, await peer_server("good"))
    assert g.peers[0].view == PeerView("n-1", "loading", True, False)
    assert g.peers[0].error == ""


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("huge", f"answer larger than {MAX_ANSWER_BYTES} bytes"),
        ("declared", "answer of 1000000000 bytes"),
        ("gzip", "answer encoded as 'gzip'"),
        ("trickle", "TimeoutError"),
    ],
)
async def test_a_peer_sending_too_much_or_too_slowly_neither_stalls_nor_bloats_the_poll(
    tmp_path: Path, peer_server: Callable[[str], Awaitable[Peer]], mode: str, error: str
) -> None:
    peer = await peer_server(mode)
    g, elapsed, peak = await poll(tmp_path, peer)
    p = g.peers[0]
    assert p.view is None and error in p.error, p.error
    # Within the poll's own deadline (poll_timeout 1 s + 0.5 s), not the body's length...
    assert elapsed < 1.5 + 0.5, elapsed
    # ... and without holding the body: far below the 64 MiB / 1 GB on offer.
    assert peak < 2 * 2**20, peak
    # The connection is dropped, so the peer cannot keep pushing.
    await asyncio.wait_for(peer.closed_by_client.wait(), 5)
    if mode == "huge":
        assert peer.sent < 64 * 2**20
