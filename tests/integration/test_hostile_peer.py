"""A multi-node leader whose follower answers the group poll with garbage: the real daemon, its
stand-in waiting for rank 1 at --dist-init-addr, and a real HTTP server on loopback in the
follower's place that answers every `GET /group` with something no JSON decoder likes.

`[` x 16000 is under group.MAX_ANSWER_BYTES and exhausts json's recursion limit
(RecursionError, not a ValueError); it used to end the group task, and the daemon stopped
SGLang and exited ("internal task failed; stopping"). Every such answer must count as no
answer: the daemon keeps running, SGLang keeps running, /status says what the peer sent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from testkit import running
from testkit.pair import node_configs

pytestmark = pytest.mark.timeout(90)

# Each under the 16 KiB cap; each raises something else inside json.loads or parse_view.
ANSWERS = (
    b"[" * 16000,  # RecursionError
    b'{"a":' * 3000,  # RecursionError, through objects
    b"\xff\xfe\x00garbage",  # UnicodeDecodeError
    b"9" * 5000,  # ValueError: an integer over the digit limit
    b'{"epoch": ["x"], "state": {}, "running": 1, "ready": null}',  # wrong types
    b"[]",  # valid JSON, not an object
)
ROUNDS = 3


class Hostile:
    """Answers GET /group with ANSWERS in turn; counts them so a test can wait for rounds."""

    def __init__(self) -> None:
        self.served = 0
        self.cond = threading.Condition()
        hostile = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with hostile.cond:
                    body = ANSWERS[hostile.served % len(ANSWERS)]
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                with hostile.cond:
                    hostile.served += 1
                    hostile.cond.notify_all()

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def wait_served(self, n: int, timeout: float) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.served >= n, timeout), self.served


@pytest.fixture
def hostile() -> Iterator[Hostile]:
    h = Hostile()
    thread = threading.Thread(target=h.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield h
    finally:
        h.server.shutdown()
        h.server.server_close()


def test_malformed_group_answers_neither_end_the_daemon_nor_stop_sglang(
    tmp_path: Path, hostile: Hostile
) -> None:
    leader_cfg, _ = node_configs(tmp_path)
    # Long enough that the unanswered peer does not end the launch during the test: what is
    # under test is that garbage is "no answer", not the partition rule.
    leader_cfg["group"] = {
        "poll_interval": "0.1s",
        "poll_timeout": "0.5s",
        "partition_timeout": "5m",
        "peers": [hostile.url],
    }
    with running(tmp_path / "node0", leader_cfg) as leader:
        leader.wait_state("loading")
        pid = leader.sglang_pid()
        hostile.wait_served(len(ANSWERS) * ROUNDS, timeout=30)
        assert leader.proc.poll() is None, leader.raw[-15:]
        doc = leader.status()
        assert doc["state"] == "loading", doc["state"]
        assert doc["child"]["pid"] == pid
        peer = doc["group"]["peers"][0]
        assert peer["reachable"] is False and peer["error"], peer
        assert "stopping" not in leader.states()
        lines = "".join(leader.raw)
        assert "internal task failed" not in lines and "poll failed" not in lines
        assert "Traceback" not in lines
        metric = next(
            line
            for line in leader.get("/metrics").text.splitlines()
            if line.startswith("kimi_serve_group_peer_up{")
        )
        assert metric.endswith(" 0.0"), metric
