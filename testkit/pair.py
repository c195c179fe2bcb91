"""Two nodes of one multi-node replica on one machine: two daemons, two stand-ins in
multi-node mode (rank 0 and rank 1 meeting at --dist-init-addr), loopback admin endpoints and
one shared token file; plus a TCP proxy a test can cut to partition the admin channel.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from testkit.daemon import base_config
from testkit.wait import free_port, wait_until


def shared_token(tmp: Path) -> Path:
    path = tmp / "group.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def node_configs(
    tmp: Path, leader_url_for_follower: Callable[[str], str] = lambda url: url
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(leader, follower) configs. `leader_url_for_follower` maps the leader's admin URL to
    the one the follower is given (a proxy's, to partition them)."""
    token = shared_token(tmp)
    dist = f"127.0.0.1:{free_port()}"
    cfgs = []
    for rank in (0, 1):
        node = tmp / f"node{rank}"
        node.mkdir()
        cfg = base_config(
            node,
            sglang={
                "args": {
                    "tp-size": 1,
                    "nnodes": 2,
                    "node-rank": rank,
                    "dist-init-addr": dist,
                },
                "env": {"STANDIN_LAUNCH_COUNTER": str(node / "launches")},
            },
            restart={"crash_loop": {"max_restarts": 50, "window": "1h"}},
            stop={"drain_timeout": "1s"},
            admin={"token_file": str(token)},
        )
        cfgs.append(cfg)
    leader, follower = cfgs
    leader_url = f"http://{leader['admin']['listen']}"
    follower_url = f"http://{follower['admin']['listen']}"
    group = {"poll_interval": "0.2s", "poll_timeout": "0.5s", "partition_timeout": "2s"}
    leader["group"] = {**group, "peers": [follower_url]}
    follower["group"] = {**group, "peers": [leader_url_for_follower(leader_url)]}
    return leader, follower


def ready(admin: str) -> bool:
    try:
        return httpx.get(admin + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def launches(cfg: dict[str, Any]) -> int:
    path = Path(cfg["sglang"]["env"]["STANDIN_LAUNCH_COUNTER"])
    return int(path.read_text().strip()) if path.exists() else 0


class Proxy:
    """A TCP forwarder on a fixed loopback port; `stop()` closes it and every connection
    through it (the port then refuses), `start()` serves again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.port = free_port()
        self._sock: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(16)
        self._sock = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s: socket.socket) -> None:
        while True:
            try:
                client, _ = s.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


def until_all(pred: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `pred` holds (`wait_until`, polled every 20 ms), or AssertionError."""
    t0 = time.monotonic()
    wait_until(pred, timeout, what)
    return time.monotonic() - t0
