"""A multi-node replica's coordination over the admin endpoints (docs/multinode.md).

The leader (node rank 0) owns the launch epoch: `<daemon nonce>-<launch number>`, so a
restarted leader daemon starts a new epoch space and every follower sees its epoch end. Every
node polls its peers' `GET /group` (bearer token) every `group.poll_interval`, each request
bounded by `group.poll_timeout` and its answer by MAX_ANSWER_BYTES (a leader that lists no
followers, as under Kubernetes, only answers); a follower also tells the leader at once
(`POST /group/end`) when its own launch ends or when it enters `failed`. What a poll means
is decided in `group_rules` (`leader_ends`, `follower_ends`, `follower_failed_ends`,
`follower_may_join`, `group_ready`); this module only talks HTTP and hands the verdict to the
loop as `GroupEnded`. Nothing here awaits a peer on the loop's critical
path: the polls run in their own task and each call has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from supervisor import log, secret_files, untrusted
from supervisor.config import Config
from supervisor.core import group_rules as rules
from supervisor.core.context import Context
from supervisor.core.events import Event, GroupEnded, Transitioned
from supervisor.core.group_rules import PeerView
from supervisor.core.states import SERVING, State
from supervisor.metrics import Metrics

# A GET /group answer is about 150 bytes. A peer that sends more is broken or hostile: reading
# stops there, so it can neither hold supervision's memory nor its time (the whole exchange is
# under poll_timeout as well).
MAX_ANSWER_BYTES = 16 * 1024


@dataclass
class _Peer:
    url: str
    view: PeerView | None = None
    last_ok: float | None = None  # clock time of the last answer
    joined: str | None = None  # the leader's epoch this follower was seen running
    error: str = ""


def parse_view(doc: Any) -> PeerView | None:
    """A GET /group body -> PeerView; None for anything malformed (counted as no answer)."""
    if not isinstance(doc, dict):
        return None
    epoch, state = doc.get("epoch"), doc.get("state")
    running, ready = doc.get("running"), doc.get("ready")
    if not (epoch is None or isinstance(epoch, str)) or not isinstance(state, str):
        return None
    if not isinstance(running, bool) or not isinstance(ready, bool):
        return None
    return PeerView(epoch, state, running, ready)


class Group:
    def __init__(
        self,
        cfg: Config,
        ctx: Context,
        http: httpx.AsyncClient,
        emit: Callable[[Event], None],
        clock: Callable[[], float],
        metrics: Metrics,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.ctx = ctx
        self.http = http
        self.emit = emit
        self.clock = clock
        self.log = log.get()
        self.role = cfg.group.role
        # Fresh for every daemon start: a restarted leader's epochs never equal the old ones.
        self.nonce = secrets.token_hex(4)
        self.joined: str | None = None  # follower: the leader's epoch of its current launch
        self.last_joined: str | None = None
        self.peers = [_Peer(url) for url in cfg.group.peers]
        self.started = clock()
        self.polled = asyncio.Event()
        self._token_problem: str | None = None
        self._told_failed: str | None = None  # follower: the leader's epoch it ended as failed
        self._failed_why = ""
        # kimi_serve_ready says what /readyz says: a follower's is gated on its leader, read
        # at scrape time (set_function makes the gauge's own set() a no-op).
        metrics.ready.set_function(lambda: 1.0 if self.ready() else 0.0)
        self._tasks: set[asyncio.Task[None]] = set()

    def reconfigure(self, cfg: Config) -> None:
        """Timings and the token file; reload.judge refuses a change of role or peers."""
        self.cfg = cfg

    # ------------------------------------------------------------------ what this node is

    def epoch(self) -> str | None:
        if self.role == "leader":
            return f"{self.nonce}-{self.ctx.launch}" if self.ctx.launch else None
        return self.joined

    def leader(self) -> PeerView | None:
        return self.peers[0].view if self.role == "follower" and self.peers else None

    def running(self) -> bool:
        return self.ctx.child and rules.epoch_running(self.ctx.state)

    def ready(self) -> bool:
        return rules.group_ready(self.role, self.ctx.state, self.joined, self.leader())

    def view(self) -> dict[str, Any]:
        """GET /group."""
        ready = self.ctx.state in SERVING if self.role == "leader" else self.ready()
        return {
            "role": self.role,
            "node_rank": self.cfg.group.node_rank,
            "epoch": self.epoch(),
            "state": self.ctx.state.value,
            "running": self.running(),
            "ready": ready,
        }

    def status(self) -> dict[str, Any]:
        """/status's `group` key."""
        now = self.clock()
        return {
            **self.view(),
            "peers": [
                {
                    "url": p.url,
                    "reachable": p.view is not None,
                    "unreachable_s": None if p.view is not None else round(self._gap(p, now), 1),
                    "epoch": p.view.epoch if p.view else None,
                    "state": p.view.state if p.view else None,
                    "ready": p.view.ready if p.view else None,
                    "error": p.error,
                }
                for p in self.peers
            ],
        }

    # ------------------------------------------------------------------ endpoint

    def end_requested(self, body: Any) -> dict[str, Any]:
        """POST /group/end {epoch}: a follower's launch of that epoch ended."""
        epoch = body.get("epoch") if isinstance(body, dict) else None
        why = body.get("why") if isinstance(body, dict) else None
        current = self.epoch()
        accepted = self.role == "leader" and epoch is not None and epoch == current
        if accepted and self.running():
            detail = f"a follower ended epoch {epoch}" + (f": {why}" if why else "")
            self.emit(GroupEnded(self.ctx.launch, detail[:300]))
        return {"accepted": accepted, "epoch": current}

    # ------------------------------------------------------------------ hooks from the loop

    def transitioned(self, t: Transitioned) -> None:
        """A follower whose launch ends tells the leader at once (the leader's poll would see
        it too, one poll later); so does one that enters `failed`, joined or not."""
        if self.role != "follower":
            return
        ended = t.old is not t.new and rules.epoch_running(t.old) and not rules.epoch_running(t.new)
        if self.joined is not None and ended:
            epoch, self.joined = self.joined, None
            if t.reason != "group":
                self._spawn_tell(epoch, t.reason)
        if t.new is State.FAILED and t.old is not t.new:
            self._failed_why = f"{t.reason}: {t.detail}" if t.detail else t.reason
            self._report_failed()

    def _report_failed(self) -> None:
        epoch = rules.follower_failed_ends(self.ctx.state, self.leader(), self._told_failed)
        if epoch is None:
            return
        self._told_failed = epoch
        why = f"follower failed ({self._failed_why})"
        self.log.warning("group: this follower failed; ending the leader's launch", epoch=epoch)
        self._spawn_tell(epoch, why[:300])

    def _spawn_tell(self, epoch: str, why: str) -> None:
        task = asyncio.get_running_loop().create_task(self._tell_end(epoch, why))
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    async def join(self) -> None:
        """Follower, host clean: wait until the leader has a new epoch starting, then take it.
        Never launches alone: with no leader answer it waits (cancelled by a stop)."""
        while not rules.follower_may_join(self.leader(), self.last_joined):
            self.polled.clear()
            await self.polled.wait()
        view = self.leader()
        assert view is not None and view.epoch is not None
        self.joined = self.last_joined = view.epoch
        self.log.info("group: joining the leader's launch", epoch=view.epoch)

    # ------------------------------------------------------------------ polling

    async def run(self) -> None:
        if not self.peers:
            return  # a leader that lists no followers only answers their polls
        while True:
            try:
                await self.poll_once()
            except Exception as exc:  # what a peer sent must never end supervision
                self.log.error("group: poll failed; polling on", error=repr(exc))
            await asyncio.sleep(self.cfg.group.poll_interval)

    async def poll_once(self) -> None:
        token = self._token()
        await asyncio.gather(*(self._poll(p, token) for p in self.peers))
        now = self.clock()
        self._decide(now)
        self.polled.set()

    def _decide(self, now: float) -> None:
        gcfg = self.cfg.group
        state = self.ctx.state
        why: str | None = None
        if self.role == "leader":
            epoch = self.epoch()
            if epoch is None:
                return
            for p in self.peers:
                v = p.view
                if v is not None and v.epoch == epoch and v.running:
                    p.joined = epoch
                why = why or rules.leader_ends(
                    epoch, state, v, p.joined == epoch, self._gap(p, now), gcfg.partition_timeout
                )
        else:
            self._report_failed()  # each new epoch of a leader that relaunches, too
            why = rules.follower_ends(
                self.joined,
                state,
                self.leader(),
                self._gap(self.peers[0], now),
                gcfg.partition_timeout,
            )
        if why is not None:
            self.log.warning("group: the launch ends", epoch=self.epoch(), why=why)
            self.emit(GroupEnded(self.ctx.launch, why))

    def _gap(self, p: _Peer, now: float) -> float:
        """How long the peer has not answered (since this daemon started, if never)."""
        if p.view is not None:
            return 0.0
        return now - (p.last_ok if p.last_ok is not None else self.started)

    def _token(self) -> str | None:
        try:
            # With the daemon's checks (a Secret's links followed, others' access refused),
            # read at each poll: a rotation needs no restart.
            token = secret_files.load(self.cfg.group.token_file).value
        except secret_files.TokenFileError as exc:
            if exc.message != self._token_problem:  # once per problem, not every poll
                self.log.error("group: token unusable", error=exc.message)
            self._token_problem = exc.message
            return None
        self._token_problem = None
        return token

    def _headers(self, token: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def _poll(self, p: _Peer, token: str | None) -> None:
        timeout = self.cfg.group.poll_timeout
        try:
            body = await asyncio.wait_for(
                self._get_capped(f"{p.url}/group", self._headers(token), timeout), timeout + 0.5
            )
            view = parse_view(untrusted.loads(body))
            if view is None:
                raise ValueError("malformed /group answer")
        except Exception as exc:  # whatever the peer sent or did: no answer (never a crash)
            if p.view is not None or not p.error:
                self.log.warning("group: peer unreachable", peer=p.url, error=str(exc) or repr(exc))
            p.view, p.error = None, str(exc) or type(exc).__name__
            self.metrics.group_peer_up.labels(p.url).set(0)
            return
        self.metrics.group_peer_up.labels(p.url).set(1)
        if p.view is None and p.last_ok is not None:
            self.log.info("group: peer reachable again", peer=p.url)
        p.view, p.last_ok, p.error = view, self.clock(), ""

    async def _get_capped(self, url: str, headers: dict[str, str], timeout: float) -> bytes:
        """The body of a 200 answer, read up to MAX_ANSWER_BYTES; ValueError beyond that
        (declared or sent) or for another status. Uncompressed only: a small compressed
        answer could inflate without bound."""
        headers = {**headers, "Accept-Encoding": "identity"}
        async with self.http.stream("GET", url, headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code}")
            return await untrusted.read_capped(r, MAX_ANSWER_BYTES)

    async def _tell_end(self, epoch: str, why: str) -> None:
        token = self._token()
        timeout = self.cfg.group.poll_timeout
        for p in self.peers:
            with contextlib.suppress(httpx.HTTPError, OSError, TimeoutError):
                # The answer is not needed: the stream is closed unread, whatever its size.
                await asyncio.wait_for(self._post(p.url, epoch, why, token, timeout), timeout + 0.5)

    async def _post(self, url: str, epoch: str, why: str, token: str | None, t: float) -> None:
        body = {"epoch": epoch, "why": why}
        headers = self._headers(token)
        async with self.http.stream(
            "POST", f"{url}/group/end", json=body, headers=headers, timeout=t
        ) as r:
            self.log.info("group: told the peer the launch ended", peer=url, status=r.status_code)


def reload_refusal(running: Config, new: Config) -> str | None:
    """Why a reloaded file cannot be taken while running, or None. The role (node rank) and
    the peers are the group's shape: a node cannot change them alone, and SGLang's own
    --node-rank must match what the other nodes run, so both apply at a start of the daemon."""
    a, b = running.group, new.group
    if (a.role, a.node_rank, a.nnodes) != (b.role, b.node_rank, b.nnodes):
        return (
            f"the multi-node role changed ({a.role}, node rank {a.node_rank} of {a.nnodes} -> "
            f"{b.role}, node rank {b.node_rank} of {b.nnodes})"
        )
    if (a.peers, a.leader) != (b.peers, b.leader):
        return f"group.peers changed ({list(a.peers)} -> {list(b.peers)})"
    return None
