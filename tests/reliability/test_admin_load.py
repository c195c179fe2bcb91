"""Scrapes and /status requests hammer the admin endpoint (it shares the daemon's event loop)
while SGLang is SIGKILLed: the death is noticed as fast as without load, and SGLang is ready
again within the same bounds.

Detection time: from the SIGKILL to the timestamp of the daemon's "state new=restarting" event.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import select
import signal
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.reliability import (
    MAX_WATCHDOG_GAP_S,
    Run,
    config,
    event_time,
    is_state,
    segments,
    soak_factor,
    supervised,
    trial,
)

pytestmark = pytest.mark.timeout(120)

CLIENTS = 8
MAX_REQUESTS = 2000
KILLS = 3
# What load may add to the detection median; and the bound on getting back to ready.
EXTRA_DETECTION_S = 0.25
READY_AGAIN_S = 10.0


class Load:
    """CLIENTS concurrent loopback clients alternating /metrics and /status, in a thread.

    It stops by itself after MAX_REQUESTS requests (or when told to)."""

    def __init__(self, admin: str, limit: int = MAX_REQUESTS) -> None:
        self.admin = admin
        self.limit = limit
        self.done = 0
        self.errors: list[str] = []
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.started = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        self.started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    @property
    def active(self) -> bool:
        return self.thread.is_alive() and self.done < self.limit

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(timeout=10, trust_env=False, limits=limits) as client:
            self.started.set()
            await asyncio.gather(*(self._client(client, i) for i in range(CLIENTS)))

    async def _client(self, client: httpx.AsyncClient, i: int) -> None:
        paths = ("/metrics", "/status")
        n = i
        while not self.stop.is_set() and self.done < self.limit:
            self.done += 1
            n += 1
            start = time.monotonic()
            try:
                r = await client.get(self.admin + paths[n % 2])
                if r.status_code != 200:
                    self.errors.append(f"{paths[n % 2]}: HTTP {r.status_code}")
            except httpx.HTTPError as exc:
                self.errors.append(f"{paths[n % 2]}: {exc!r}")
            self.latencies.append(time.monotonic() - start)


def kill_and_recover(run: Run, load: Load | None = None) -> tuple[float, float]:
    """SIGKILL SGLang; (seconds until the daemon said restarting, until ready again)."""
    if load is not None:
        assert load.active, "the load ran out before the kill"
    _, at = run.kill_sglang(signal.SIGKILL)
    restarting = run.d.wait_for(is_state("restarting"), timeout=20, what="restarting")
    assert restarting["reason"] == "exited"
    ready = run.d.wait_for(is_state("ready"), timeout=READY_AGAIN_S + 5, what="ready again")
    return event_time(restarting) - at, event_time(ready) - at


def test_restart_detection_under_admin_load(tmp_path: Path) -> None:
    kills = KILLS * soak_factor()
    # Every kill counts towards a crash loop; this test is not about that.
    cfg = config(tmp_path, restart={"crash_loop": {"max_restarts": 100, "window": "1h"}})
    with (
        trial("admin load", f"SIGKILL of SGLang under {CLIENTS} concurrent admin clients") as t,
        supervised(tmp_path, cfg, t) as run,
    ):
        run.d.wait_state("ready")
        quiet = [kill_and_recover(run) for _ in range(kills)]
        # A fresh load for each kill, so that every kill lands while requests are in flight;
        # together they stay within MAX_REQUESTS (per KILLS kills).
        loaded, errors, latencies, served = [], [], [], 0
        for _ in range(kills):
            with Load(run.d.admin, limit=MAX_REQUESTS // KILLS) as load:
                deadline = time.monotonic() + 5
                while load.done < 20 and time.monotonic() < deadline:
                    time.sleep(0.01)
                loaded.append(kill_and_recover(run, load))
            served += load.done
            errors += load.errors
            latencies += load.latencies
        detect_q = statistics.median(d for d, _ in quiet)
        detect_l = statistics.median(d for d, _ in loaded)
        ready_q = statistics.median(r for _, r in quiet)
        ready_l = statistics.median(r for _, r in loaded)
        t.notes.update(
            detect_quiet_ms=round(detect_q * 1000),
            detect_loaded_ms=round(detect_l * 1000),
            ready_quiet_s=round(ready_q, 2),
            ready_loaded_s=round(ready_l, 2),
            requests=served,
            errors=len(errors),
            p99_ms=round(1000 * sorted(latencies)[int(0.99 * (len(latencies) - 1))]),
        )
        assert not errors, errors[:5]
        assert served <= MAX_REQUESTS * soak_factor()
        assert detect_l - detect_q < EXTRA_DETECTION_S, t.notes
        assert all(r < READY_AGAIN_S for _, r in quiet + loaded), (quiet, loaded)
        assert ready_l - ready_q < 1.0, t.notes
        gap = run.notify.max_watchdog_gap(until=time.monotonic())
        t.notes["watchdog_gap_s"] = round(gap, 2)
        assert gap < MAX_WATCHDOG_GAP_S
        segs = segments(run.events())
        assert len(segs) == 2 * kills + 1
        t.recovered = True


FD_LIMIT = 256


def test_idle_admin_connections_never_stop_a_relaunch(tmp_path: Path) -> None:
    """A scraper that leaks connections (FD_LIMIT+ idle sockets) while SGLang dies."""
    cfg = config(tmp_path, restart={"crash_loop": {"max_restarts": 4, "window": "1h"}})
    limit = (FD_LIMIT, FD_LIMIT)
    with (
        trial(
            "admin load",
            "idle admin connections use up the daemon's file descriptors",
        ) as t,
        supervised(
            tmp_path, cfg, t, preexec=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit)
        ) as run,
        contextlib.ExitStack() as conns,
    ):
        run.d.wait_state("ready")
        pid = run.status()["child"]["pid"]
        host, port = cfg["admin"]["listen"].rsplit(":", 1)
        for _ in range(FD_LIMIT + 50):
            conns.enter_context(socket.create_connection((host, int(port))))
        os.kill(pid, signal.SIGKILL)
        # Held until the daemon has either given up, relaunched anyway, or waited out three
        # host-not-ready retries (what a daemon that knows EMFILE is the host's problem does).
        retries = []

        def settled(e: dict[str, Any]) -> bool:
            if e.get("event") == "state" and e.get("reason") == "host_not_ready":
                retries.append(e)
            return is_state("ready")(e) or is_state("failed")(e) or len(retries) >= 3

        held = run.d.wait_for(settled, timeout=30, what="the relaunch, or its trouble")
        conns.close()  # the scraper goes away
        assert not is_state("failed")(held), f"gave up for good: {held}"
        # The admin port holds at most Limits.max_connections of them (the others are closed
        # at once), so the relaunch never runs short of descriptors.
        assert retries == [] and is_state("ready")(held), (retries, held)
        t.recovered = True


class Abuse:
    """Hostile clients of the admin port, each in its own thread, until stopped:

    - slowloris: connections that trickle header bytes and never finish a request;
    - a connection hoarder: as many idle connections as the port takes (over its limit);
    - big bodies: POST /restart with a body over the limit (and the right token);
    - garbage: malformed request lines and headers;
    - guessing: POST /restart, /drain, /undrain with wrong tokens.
    """

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self.token = host, port, token
        self.stop = threading.Event()
        self.answers: dict[str, list[bytes]] = {}
        self.threads = [
            threading.Thread(target=getattr(self, name), daemon=True)
            for name in ("slowloris", "hoard", "big_bodies", "garbage", "guessing")
        ]

    def __enter__(self) -> Abuse:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15)

    def _send(self, kind: str, data: bytes) -> None:
        try:
            with socket.create_connection((self.host, self.port), timeout=5) as s:
                s.sendall(data)
                answer = s.recv(200)
        except OSError as exc:
            answer = repr(exc).encode()
        self.answers.setdefault(kind, []).append(answer)

    def slowloris(self) -> None:
        conns: list[socket.socket] = []
        with contextlib.ExitStack() as stack:
            while not self.stop.is_set():
                if len(conns) < 20:
                    with contextlib.suppress(OSError):
                        s = stack.enter_context(socket.create_connection((self.host, self.port)))
                        s.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n")
                        conns.append(s)
                for s in list(conns):
                    try:
                        s.sendall(b"X")
                    except OSError:
                        conns.remove(s)  # cut off by the server: the point
                        self.answers.setdefault("slowloris cut", []).append(b"")
                self.stop.wait(0.5)

    def hoard(self) -> None:
        conns: list[socket.socket] = []
        try:
            while not self.stop.is_set():
                with contextlib.suppress(OSError):
                    conns.append(socket.create_connection((self.host, self.port)))
                # Connections the server closed to make room (read end of file, or reset).
                readable, _, _ = select.select(conns, [], [], 0)
                for s in readable:
                    try:
                        data = s.recv(200)
                    except OSError:
                        data = b""
                    if not data:
                        conns.remove(s)
                        s.close()
                        self.answers.setdefault("hoard evicted", []).append(b"")
                self.stop.wait(0.02)
        finally:
            for s in conns:
                s.close()

    def big_bodies(self) -> None:
        head = (
            f"POST /restart HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.token}\r\n"
            "Content-Length: 100000000\r\n\r\n"
        ).encode()
        while not self.stop.is_set():
            self._send("big body", head + b"x" * 65536)
            self.stop.wait(0.05)

    def garbage(self) -> None:
        payloads = [
            b"\x00\xff\xfe garbage\r\n\r\n",
            b"GET /status HTTP/1.1\r\n" + b"X: " + b"a" * 20000 + b"\r\n\r\n",
            b"POST /restart HTTP/9.9\r\n\r\n",
        ]
        i = 0
        while not self.stop.is_set():
            self._send("garbage", payloads[i % len(payloads)])
            i += 1
            self.stop.wait(0.02)

    def guessing(self) -> None:
        i = 0
        while not self.stop.is_set():
            path = ("/restart", "/drain", "/undrain")[i % 3]
            guess = f"{self.token[:-1]}{'A' if self.token[-1] != 'A' else 'B'}"
            self._send(
                "guess",
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {guess}\r\n"
                "Connection: close\r\nContent-Length: 0\r\n\r\n".encode(),
            )
            i += 1
            self.stop.wait(0.02)


def test_hostile_admin_clients_neither_restart_nor_stall_the_daemon(tmp_path: Path) -> None:
    cfg = config(tmp_path, restart={"crash_loop": {"max_restarts": 100, "window": "1h"}})
    host, port = cfg["admin"]["listen"].rsplit(":", 1)
    with (
        trial(
            "admin load", "slowloris, connection hoarding, big bodies, garbage, token guessing"
        ) as t,
        supervised(tmp_path, cfg, t) as run,
    ):
        run.d.wait_state("ready")
        token = run.d.token_file.read_text().strip()
        since = time.monotonic()
        with Abuse(host, int(port), token) as abuse:
            # The abuse must be in full swing: the connection limit reached (hoarded
            # connections closed to make room), and slow clients cut off by the server (the
            # request timeout), not by us.
            def saturated() -> bool:
                return bool(abuse.answers.get("hoard evicted")) and bool(
                    abuse.answers.get("slowloris cut")
                )

            deadline = time.monotonic() + 30
            while not saturated() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert saturated(), {k: v[-3:] for k, v in abuse.answers.items()}
            # An operator's or a probe's request, each on a new connection, gets its answer.
            latencies = []
            for _ in range(20):
                start = time.monotonic()
                r = httpx.get(run.d.admin + "/livez", timeout=5, trust_env=False)
                latencies.append(time.monotonic() - start)
                assert r.status_code == 200, r.text
            t.notes["livez_max_ms"] = round(max(latencies) * 1000)
            # Supervision goes on: a death is seen and SGLang relaunched, under the abuse.
            _, at = run.kill_sglang(signal.SIGKILL)
            restarting = run.d.wait_for(is_state("restarting"), timeout=20, what="restarting")
            run.d.wait_for(is_state("ready"), timeout=READY_AGAIN_S + 5, what="ready again")
            t.notes["detect_ms"] = round((event_time(restarting) - at) * 1000)
        gap = run.notify.max_watchdog_gap(since=since, until=time.monotonic())
        t.notes["watchdog_gap_s"] = round(gap, 2)
        t.notes.update({k: len(v) for k, v in abuse.answers.items()})
        assert gap < MAX_WATCHDOG_GAP_S
        # Nothing the hostile clients sent restarted anything: the one restart is the kill.
        status = run.status()
        assert status["restarts"] == {"exited": 1}, status["restarts"]
        big = abuse.answers["big body"]
        assert not any(b" 202 " in a for a in big), big[:3]
        assert any(b" 413 " in a for a in big), big[:3]
        guesses = abuse.answers["guess"]
        assert guesses and not any(b" 20" in a[:13] for a in guesses), guesses[:3]
        # Once the hostile clients are gone the endpoint answers at once.
        assert httpx.get(run.d.admin + "/livez", timeout=2, trust_env=False).status_code == 200
        metrics = run.d.get("/metrics").text
        denied = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("kimi_serve_admin_denied_total{")
        )
        assert denied >= 1, metrics
        t.notes["denied"] = int(denied)
        t.recovered = True
