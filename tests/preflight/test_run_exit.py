"""`kimi-serve run` refuses, in seconds and with exit 78, a command line the installed SGLang
rejects: no ten-minute load ends in "ambiguous option", and systemd does not restart-loop."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from testkit import BIN, base_config, owned_processes


def _notify_socket(tmp: Path) -> tuple[socket.socket, str]:
    path = str(tmp / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0)
    return sock, path


@pytest.mark.parametrize(
    ("args", "sglang_says", "hint"),
    [
        (
            {"cuda-graph-max-bs": 128},
            "ambiguous option: --cuda-graph-max-bs",
            "cuda-graph-max-bs-decode",
        ),
        ({"reasoning-parser": "nope"}, "invalid choice: 'nope'", ""),
        ({"frobnicate": 3}, "unrecognized arguments: --frobnicate", ""),
    ],
)
def test_run_exits_78_on_a_rejected_flag(
    sglang_python: str, tmp_path: Path, args: dict[str, object], sglang_says: str, hint: str
) -> None:
    cfg = base_config(tmp_path)
    cfg["sglang"]["python"] = sglang_python
    cfg["sglang"]["module"] = "sglang.launch_server"
    cfg["sglang"]["args"] = {"tp-size": 1, **args}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    sock, sock_path = _notify_socket(tmp_path)
    start = time.monotonic()
    r = subprocess.run(
        [str(BIN), "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NOTIFY_SOCKET": sock_path},
    )
    elapsed = time.monotonic() - start
    assert r.returncode == 78, r.stdout[-2000:] + r.stderr[-2000:]
    assert elapsed < 30, f"took {elapsed:.1f} s"
    out = r.stdout + r.stderr
    assert "Traceback" not in out
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    messages = " ".join(str(e) for e in events)
    assert sglang_says in messages
    assert hint in messages
    # The key the flag came from, with its line, as a config error names it.
    flag = next(iter(args))
    lines = path.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.strip().startswith(f"{flag}:"))
    assert f"(set at sglang.args.{flag} in {path}:{line})" in messages
    # Nothing was launched.
    assert not any(e.get("event") == "launched sglang" for e in events)
    assert not owned_processes(str((tmp_path / "state").resolve()))
    # systemd is told why, on one line.
    datagrams = []
    while True:
        try:
            datagrams.append(sock.recv(4096).decode())
        except BlockingIOError:
            break
    status = [d for d in datagrams if d.startswith("STATUS=")]
    assert status and "preflight config problem" in status[-1]
    assert "READY=1" not in "".join(datagrams)
