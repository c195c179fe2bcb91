"""Secrets at the edges, run as an attacker would: a bearer value that is not UTF-8 on a raw
socket to the real daemon, a link another user (nobody, uid 65534) planted in the CLI's token
path, and a router key file others may read."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import yaml

from testkit import base_config, running
from testkit.cli import kimi_serve

pytestmark = pytest.mark.timeout(90)

NOBODY = 65534


def raw_request(admin: str, request: bytes) -> bytes:
    host, port = admin.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def denied(metrics: str, endpoint: str) -> float:
    prefix = f'kimi_serve_admin_denied_total{{endpoint="{endpoint}"}} '
    return float(next(ln for ln in metrics.splitlines() if ln.startswith(prefix))[len(prefix) :])


@pytest.mark.skipif(os.geteuid() != 0, reason="lchown to another user needs root")
def test_non_utf8_bearer_is_denied_and_a_planted_token_link_is_not_followed(
    tmp_path: Path,
) -> None:
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        before = d.get("/metrics").text

        # Bytes no decoder accepts as UTF-8, where the token goes.
        for method, path in ((b"POST", b"/restart"), (b"GET", b"/status")):
            answer = raw_request(
                d.admin,
                method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n"
                b"Authorization: Bearer \xff\xfe\xc3\x28" + b"A" * 40 + b"\r\n"
                b"Content-Length: 0\r\nConnection: close\r\n\r\n",
            )
            assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
        after = d.get("/metrics").text
        for endpoint in ("/restart", "/status"):
            assert denied(after, endpoint) == denied(before, endpoint) + 1, endpoint
        assert "admin request failed" not in "".join(d.raw)

        # Another user's link to the real token: the CLI (root) must not follow it.
        planted = tmp_path / "planted.token"
        os.symlink(d.token_file, planted)
        os.lchown(planted, NOBODY, NOBODY)
        done = kimi_serve("restart", "--config", str(d.config_path), "--token-file", str(planted))
        assert done.returncode == 77, done
        assert f"the link {planted} belongs to uid {NOBODY}" in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1
        # The same link, root's: followed.
        os.lchown(planted, 0, 0)
        done = kimi_serve("restart", "--config", str(d.config_path), "--token-file", str(planted))
        assert done.returncode == 0, done
        assert d.wait_state("restarting")["reason"] == "manual"
        assert d.status()["restarts"] == {"manual": 1}


@pytest.mark.parametrize("mode", [0o644, 0o620])
def test_a_router_key_others_may_read_or_the_group_write_stops_the_start_with_78(
    tmp_path: Path, mode: int
) -> None:
    key = tmp_path / "router.key"
    key.write_text("k" * 40 + "\n")
    key.chmod(mode)
    cfg = base_config(tmp_path, router={"url": "http://127.0.0.1:1", "api_key_file": str(key)})
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = kimi_serve("run", "--config", str(path))
    assert done.returncode == 78, done
    assert f"router.api_key_file {key} is mode {mode:04o}" in done.stderr, done.stderr
    assert f"(router.api_key_file in {path})" in done.stderr


def test_check_warns_of_a_router_key_in_clear_http_to_another_host(tmp_path: Path) -> None:
    key = tmp_path / "router.key"
    key.write_text("k" * 40 + "\n")
    key.chmod(0o600)
    for url, warned in (("http://10.1.2.3:30080", True), ("http://127.0.0.1:30080", False)):
        cfg = base_config(
            tmp_path,
            router={"url": url, "api_key_file": str(key), "worker_url": "http://10.1.2.4:30000"},
        )
        path = tmp_path / "kimi-serve.yaml"
        path.write_text(yaml.safe_dump(cfg))
        done = kimi_serve("check", "--config", str(path))
        assert done.returncode == 0, done
        assert ("sent in clear HTTP to " in done.stderr) is warned, done.stderr
