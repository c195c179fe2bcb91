"""SGLang's access lines for the daemon's own requests go to debug; everyone else's stay at info.

The server is real uvicorn in SGLang 0.5.23's environment, logging with SGLang's own format
(testkit/uvicorn_access.py); the daemon's side is its real client transport (OwnPorts) and its
real log pump. The lines are told apart by the client port, never by the path: a foreign
`POST /generate` stays at info beside the daemon's.
"""

from __future__ import annotations

import queue
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import structlog

from supervisor import config
from supervisor.daemon.logpump import LogPump
from supervisor.metrics import Metrics
from supervisor.sglang.logscan import Stream
from supervisor.sglang.own_ports import OwnPorts, access_client
from testkit import free_port
from testkit.paths import REPO_ROOT
from testkit.preflight import sglang_python  # noqa: F401 (the session fixture)
from testkit.realsglang import BUILD_TIMEOUT

# The first test to ask for SGLang's environment may pay for building it.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 60)


class Server:
    def __init__(self, python: str) -> None:
        self.port = free_port()
        script = Path(REPO_ROOT) / "testkit" / "uvicorn_access.py"
        self.proc = subprocess.Popen(
            [python, str(script), str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_running(self) -> None:
        while "Uvicorn running on" not in self.lines.get(timeout=60):
            pass

    def access_lines(self, n: int) -> list[str]:
        got: list[str] = []
        while len(got) < n:
            line = self.lines.get(timeout=30)
            if access_client(line) is not None:
                got.append(line)
        return got


@pytest.fixture
def server(sglang_python: str) -> Iterator[Server]:  # noqa: F811 (the fixture imported above)
    s = Server(sglang_python)
    try:
        s.wait_running()
        yield s
    finally:
        s.proc.kill()
        s.proc.wait(10)


async def test_the_daemons_own_access_lines_are_debug_real_traffic_info(server: Server) -> None:
    base = f"http://127.0.0.1:{server.port}"
    own = OwnPorts()
    async with (
        httpx.AsyncClient(trust_env=False, transport=own.transport()) as daemon,
        httpx.AsyncClient(trust_env=False) as user,
    ):
        assert (await daemon.post(base + "/generate", json={})).status_code == 200
        assert (await user.post(base + "/generate", json={})).status_code == 200
        # A second request of the daemon on its kept-alive connection, then a new connection.
        assert (await daemon.get(base + "/metrics")).status_code == 200
        async with httpx.AsyncClient(trust_env=False, transport=own.transport()) as fresh:
            assert (await fresh.get(base + "/server_info")).status_code == 200
        lines = server.access_lines(4)

    # SGLang's format (common.py:3516): `[time] INFO:     127.0.0.1:PORT - "POST /generate ..."`
    for line in lines:
        assert line.startswith("[") and "] INFO:     127.0.0.1:" in line, line
        assert line.endswith('HTTP/1.1" 200 OK'), line

    cfg = config.parse("sglang: {model_path: /m}\n", "t.yaml")
    pump = LogPump(cfg, Metrics(), lambda: 0.0, lambda _e: None, own_request=own.ours)
    with structlog.testing.capture_logs() as logs:
        pump.lines(1, Stream.STDOUT, lines)
    levels = {e["event"]: e["log_level"] for e in logs}
    by_path = {}
    for line, level in levels.items():
        by_path.setdefault(line.split('"')[1], []).append(level)
    assert sorted(by_path["POST /generate HTTP/1.1"]) == ["debug", "info"], levels
    assert by_path["GET /metrics HTTP/1.1"] == ["debug"], levels
    assert by_path["GET /server_info HTTP/1.1"] == ["debug"], levels
    # The user's line is the info one: its port is not one of the daemon's.
    user_line = next(line for line, level in levels.items() if level == "info")
    assert not own.ours(user_line)
