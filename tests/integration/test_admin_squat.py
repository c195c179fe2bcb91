"""Squatting the admin port, as another local user would: a listener run as `nobody`
(uid 65534, through setpriv) on the admin address, answering "ready" to whoever asks and
keeping whatever it is sent.

- The daemon binds the admin port before preflight: while preflight runs (held here on a
  FIFO, in SGLang's parser), the squatter cannot bind it, and `kimi-serve status` gets the
  daemon's own "starting".
- With the squatter on the port first, `kimi-serve status`, `restart` and `drain` (root, with
  the token) send it nothing, not even a request line, and do not print its answer as the
  service's: exit 5 and one line saying who holds the port. The daemon itself exits 1 at once,
  naming the holder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from testkit import base_config
from testkit.cli import kimi_serve
from testkit.daemon import DaemonProcess, reaped

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(
        os.geteuid() != 0
        or shutil.which("setpriv") is None
        or not Path("/usr/bin/python3").exists(),
        reason="needs root, setpriv and /usr/bin/python3 (to run a listener as nobody)",
    ),
]

NOBODY = 65534
# The squatter: binds, says so, then for each connection reports what it was sent (up to the
# end of a request head, or the client's close) and answers a forged "ready".
SQUATTER = r"""
import json, socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError as exc:
    print("bind-failed", exc.errno, flush=True)
    sys.exit(0)
s.listen()
print("listening", flush=True)
body = json.dumps({"state": "ready", "version": "forged"}).encode()
while True:
    c, _ = s.accept()
    c.settimeout(5)
    got = b""
    try:
        while b"\r\n\r\n" not in got:
            chunk = c.recv(65536)
            if not chunk:
                break
            got += chunk
    except OSError:
        pass
    print("got", len(got), "authorization" if b"authorization:" in got.lower() else "-",
          flush=True)
    if got:
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    c.close()
"""


class Squatter:
    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen(
            [
                "setpriv",
                f"--reuid={NOBODY}",
                f"--regid={NOBODY}",
                "--clear-groups",
                "/usr/bin/python3",
                "-c",
                SQUATTER,
                str(port),
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        assert self.proc.stdout is not None
        self.first = self.proc.stdout.readline().strip()

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def squatters() -> Iterator[list[Squatter]]:
    started: list[Squatter] = []
    yield started
    for s in started:
        s.stop()


def write_config(tmp_path: Path, cfg: dict[str, object]) -> Path:
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_daemon_holds_the_admin_port_during_preflight(
    tmp_path: Path, squatters: list[Squatter]
) -> None:
    # SGLang's parser runs through this interpreter: it waits on the FIFO, so preflight
    # lasts until the test says.
    fifo = tmp_path / "preflight.fifo"
    os.mkfifo(fifo)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nread _ < {fifo}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    cfg = base_config(tmp_path)
    cfg["sglang"]["python"] = str(wrapper)
    cfg["sglang"]["module"] = "sglang.launch_server"
    port = int(cfg["admin"]["listen"].rsplit(":", 1)[1])
    path = write_config(tmp_path, cfg)
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "KIMI_SERVE_CONFIG")}
    with reaped(DaemonProcess.start(path, cfg, env)) as d:
        d.wait_for(lambda e: e.get("event") == "admin endpoint", 20, "the admin endpoint")
        done = kimi_serve("status", "--config", str(path))
        assert done.returncode == 3 and "State: starting" in done.stdout, done
        squatters.append(Squatter(port))
        assert squatters[-1].first.startswith("bind-failed 98"), squatters[-1].first  # EADDRINUSE
        # Preflight goes on; its end does not matter here (the parser finds no SGLang).
        with open(fifo, "w") as f:
            f.write("go\n")
        d.stop()


def test_the_cli_sends_nothing_to_a_squatter_and_the_daemon_names_it(
    tmp_path: Path, squatters: list[Squatter]
) -> None:
    cfg = base_config(tmp_path)
    state = Path(cfg["state_dir"])
    state.mkdir(mode=0o700)
    token = state / "admin.token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"t" * 43 + b"\n")
    os.close(fd)
    port = int(cfg["admin"]["listen"].rsplit(":", 1)[1])
    path = write_config(tmp_path, cfg)
    squatter = Squatter(port)
    squatters.append(squatter)
    assert squatter.first == "listening"

    for command in ("status", "restart", "drain"):
        done = kimi_serve(command, "--config", str(path))
        # status: unreachable (the contract's 4); the control commands: 5, not the service.
        assert done.returncode == (4 if command == "status" else 5), (command, done)
        assert done.stdout == "" and done.stderr.count("\n") == 1, done
        assert f"is held by uid {NOBODY} (nobody), not by root or the service user" in done.stderr
        assert "not sending the admin token" in done.stderr
        # The squatter's connection was opened, checked and closed: no byte reached it.
        assert squatter.line() == "got 0 -", command

    done = kimi_serve("run", "--config", str(path))
    assert done.returncode == 1, done
    assert f"held by uid {NOBODY} (nobody)" in done.stderr + done.stdout, done
