"""`kimi-serve preflight` on a serving host: the port held by the running daemon's own SGLang
passes ("serving", exit 0); the same port held by anything else still fails (exit 1). The real
daemon with the stand-in, the real CLI; who the daemon is comes from its authenticated /status."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from testkit import base_config, running
from testkit.cli import kimi_serve

pytestmark = pytest.mark.timeout(90)


def test_preflight_knows_its_own_sglang_and_still_catches_a_foreign_holder(
    tmp_path: Path,
) -> None:
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        sglang = d.sglang_pid()
        path = str(d.config_path)

        done = kimi_serve("preflight", "--config", path)
        assert done.returncode == 0, done.stdout + done.stderr
        port_line = next(ln for ln in done.stdout.splitlines() if ln.split()[1:2] == ["port"])
        assert port_line.startswith("ok") and f"own SGLang (pid {sglang}" in port_line
        assert f"daemon pid {d.proc.pid}" in port_line
        assert done.stdout.splitlines()[-1].startswith("serving: ")

        as_json = kimi_serve("preflight", "--config", path, "--json")
        assert as_json.returncode == 0, as_json.stderr
        doc = json.loads(as_json.stdout)
        assert doc["serving"] is True and doc["exit_code"] == 0
        port = next(c for c in doc["checks"] if c["name"] == "port")
        assert port["ok"] and port["serving"] and port["status"] == "ok"

        # Another program on the port the config names: the daemon answers, but the holder
        # does not descend from it.
        with socket.socket() as foreign:
            foreign.bind(("127.0.0.1", 0))
            foreign.listen()
            other = {**cfg, "sglang": {**cfg["sglang"], "port": foreign.getsockname()[1]}}
            other_path = tmp_path / "foreign.yaml"
            other_path.write_text(yaml.safe_dump(other))
            done = kimi_serve("preflight", "--config", str(other_path))
            assert done.returncode == 1, done.stdout + done.stderr
            assert "FAIL  port" in done.stdout
            assert "is not a process of the running kimi-serve" in done.stdout
            doc = json.loads(kimi_serve("preflight", "--config", str(other_path), "--json").stdout)
            assert doc["exit_code"] == 1 and doc["serving"] is False

    # No daemon any more: the port is free again and nothing claims to serve.
    done = kimi_serve("preflight", "--config", path)
    assert done.returncode == 0 and "serving" not in done.stdout, done.stdout
