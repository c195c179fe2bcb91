"""The router section of the config, `check`'s warnings, router.py's pure parts, and the
admin drain's answer without a router."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from supervisor import config
from supervisor.metrics import Metrics
from supervisor.router import (
    DrainResult,
    Failure,
    Known,
    answer_drain,
    backoff,
    link_for,
    parse_added,
    parse_load,
    parse_workers,
    same_url,
    waited_for,
)

KIMI_SERVE = Path(sys.executable).with_name("kimi-serve")
BASE = "sglang:\n  model_path: /m\n  host: {host}\n  port: 30001\n"


def parse(router: str, host: str = "127.0.0.1", args: str = "") -> config.Config:
    text = BASE.format(host=host) + args + router
    return config.parse(text, "t.yaml")


def test_no_router_section_means_no_registration() -> None:
    cfg = config.parse("sglang:\n  model_path: /m\n", "t.yaml")
    assert cfg.router.url is None and not cfg.router.enabled
    assert config.warnings(cfg) == []


def test_worker_url_defaults_to_sglang_host_and_port() -> None:
    cfg = parse("router:\n  url: http://127.0.0.1:30080/\n", host="10.0.0.7")
    assert cfg.router.url == "http://127.0.0.1:30080"  # trailing slash dropped
    assert cfg.router.worker_url == "http://10.0.0.7:30001"
    assert cfg.router.drain_timeout == 30.0 and cfg.router.api_key_file is None


def test_worker_url_of_an_ipv6_host() -> None:
    cfg = parse("router:\n  url: http://[::1]:30080\n", host="'::1'")
    assert cfg.router.worker_url == "http://[::1]:30001"


def test_a_wildcard_bind_is_named_by_hostname_for_a_remote_router() -> None:
    import socket

    cfg = parse("router:\n  url: http://10.0.0.5:30080\n", host="0.0.0.0")
    assert cfg.router.worker_url == f"http://{socket.gethostname()}:30001"
    local = parse("router:\n  url: http://127.0.0.1:30080\n", host="0.0.0.0")
    assert local.router.worker_url == "http://127.0.0.1:30001"


def test_api_key_file_must_be_readable(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cfg = parse(f"router:\n  url: http://127.0.0.1:1\n  api_key_file: {token}\n")
    assert cfg.router.api_key_file == str(token)
    with pytest.raises(config.ConfigError, match="is a directory"):
        parse(f"router:\n  url: http://127.0.0.1:1\n  api_key_file: {tmp_path}\n")


def test_loopback_worker_url_with_a_remote_router_warns() -> None:
    cfg = parse(
        "router:\n  url: http://10.0.0.5:30080\n", args="  args:\n    enable-metrics: true\n"
    )
    (warning,) = config.warnings(cfg)
    assert "router.worker_url: http://127.0.0.1:30001 is a loopback address" in warning
    fine = parse(
        "router:\n  url: http://10.0.0.5:30080\n  worker_url: http://10.0.0.7:30001\n",
        args="  args:\n    enable-metrics: true\n",
    )
    assert config.warnings(fine) == []


def test_missing_enable_metrics_warns_for_drains() -> None:
    cfg = parse("router:\n  url: http://127.0.0.1:30080\n")
    (warning,) = config.warnings(cfg)
    assert "enable-metrics" in warning


def test_check_prints_warnings_and_still_exits_0(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text(BASE.format(host="127.0.0.1") + "router:\n  url: http://10.0.0.5:30080\n")
    r = subprocess.run(
        [str(KIMI_SERVE), "check", "--config", str(path)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
    assert f"{path}: warning: router.worker_url" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------ parsers


LISTED = (
    b'{"workers":[{"id":"d3c9","url":"http://127.0.0.1:49827","is_healthy":true,"load":0}],'
    b'"total":1}'
)


def test_parse_workers_reads_the_real_shape() -> None:
    (w,) = parse_workers(200, LISTED, "application/json")  # type: ignore[misc]
    assert (w.id, w.url, w.healthy) == ("d3c9", "http://127.0.0.1:49827", True)


@pytest.mark.parametrize(
    ("status", "body", "ctype", "kind", "text"),
    [
        (500, b"<html>oops</html>", "text/html", "http_status", "HTTP 500: <html>oops</html>"),
        (200, b"<html>hi</html>", "text/html; charset=utf-8", "malformed", "(text/html)"),
        (200, b"[]", "application/json", "malformed", "without a workers list"),
        (200, b'{"workers":[1]}', "application/json", "malformed", "not an object"),
        (200, b'{"workers":[{"id":1}]}', "application/json", "malformed", "no id or url"),
        (200, b"\xff\xfe", "", "malformed", "(no content type)"),
    ],
)
def test_parse_workers_classifies_nonsense(
    status: int, body: bytes, ctype: str, kind: str, text: str
) -> None:
    got = parse_workers(status, body, ctype)
    assert isinstance(got, Failure) and got.kind == kind and text in got.message, got


def test_parse_added() -> None:
    assert parse_added(202, b'{"status":"accepted","worker_id":"abc"}', "application/json") == "abc"
    bad = parse_added(400, b'{"error":"Invalid URL"}', "application/json")
    assert isinstance(bad, Failure) and "HTTP 400" in bad.message and bad.op == "register"
    assert isinstance(parse_added(202, b'{"worker_id":""}', ""), Failure)


def test_parse_added_reads_smgs_409s_as_known() -> None:
    """SMG 1.13's answers to a POST of a URL it is adding or lists (measured, test_smg.py)."""
    body = (
        b'{"error":"Worker creation already in progress for URL \'http://h:1\' with ID x. '
        b'Poll GET /workers/x.","code":"WORKER_CREATE_IN_PROGRESS"}'
    )
    got = parse_added(409, body, "application/json")
    assert isinstance(got, Known) and got.code == "WORKER_CREATE_IN_PROGRESS"
    assert got.message.startswith("Worker creation already in progress for URL 'http://h:1'")
    exists = parse_added(
        409, b'{"error":"Worker already exists","code":"WORKER_ALREADY_EXISTS"}', ""
    )
    assert exists == Known("WORKER_ALREADY_EXISTS", "Worker already exists")
    for other in (b'{"error":"no","code":"CONFLICT"}', b"<html>409</html>", b"[1]"):
        failed = parse_added(409, other, "application/json")
        assert isinstance(failed, Failure) and "HTTP 409" in failed.message, other


def test_an_entry_smg_is_adding_is_not_yet_registered() -> None:
    body = b'{"workers":[{"id":"x","url":"http://h:1","is_healthy":false,"status":"pending"}]}'
    (w,) = parse_workers(200, body, "application/json")  # type: ignore[misc]
    assert w.adding and not w.leaving


def test_parse_load_sums_ranks_and_needs_the_running_gauge() -> None:
    text = (
        'sglang:num_running_reqs{tp_rank="0"} 2.0\n'
        'sglang:num_running_reqs{tp_rank="1"} 1.0\n'
        'sglang:num_queue_reqs{tp_rank="0"} 4.0\n'
    )
    assert parse_load(text) == (3.0, 4.0)
    assert parse_load("sglang:generation_tokens_total 5\n") is None
    assert parse_load("{{{ not prometheus") is None


def test_same_url() -> None:
    assert same_url("http://Host:80/", "http://host")
    assert same_url("http://127.0.0.1:1/", "http://127.0.0.1:1")
    assert not same_url("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert not same_url("https://h:1", "http://h:1")


def test_backoff_is_exponential_capped_and_jittered() -> None:
    rng = random.Random(7).random
    delays = [backoff(n, 0.5, 30.0, rng) for n in range(12)]
    for n, d in enumerate(delays):
        step = min(30.0, 0.5 * 2**n)
        assert step / 2 <= d <= step
    assert max(delays) <= 30.0
    assert backoff(10_000, 0.5, 30.0, lambda: 1.0) == 30.0


def test_an_entry_smg_is_draining_counts_as_removed() -> None:
    body = b'{"workers":[{"id":"x","url":"http://h:1","is_healthy":false,"status":"draining"}]}'
    (w,) = parse_workers(200, body, "application/json")  # type: ignore[misc]
    assert w.leaving and w.status == "draining" and w.healthy is False


async def test_a_drain_without_a_router_waits_and_says_for_what() -> None:
    waits: list[str] = []

    async def idle() -> DrainResult:
        waits.append("waited")
        return DrainResult(True, 1.5, 0.0, 0.0)

    what = waited_for("http://127.0.0.1:30001/", 30.0)
    assert what == (
        "SGLang's running and queued requests to reach 0 (sglang:num_running_reqs + "
        "sglang:num_queue_reqs at http://127.0.0.1:30001/metrics), at most "
        "router.drain_timeout 30s"
    )
    got = await answer_drain(None, lambda: None, idle, what)
    assert got.status == 200 and waits == ["waited"]
    assert got.body["router"] is None and "nothing to deregister" in got.body["note"]
    assert got.body["drain"] == {
        "idle": True,
        "waited_s": 1.5,
        "running": 0.0,
        "queued": 0.0,
        "error": None,
    }
    assert got.body["waited_for"] == what
    # Refused by the machine: nothing is waited for.
    refused = await answer_drain(None, lambda: "nothing to drain", idle, what)
    assert refused.status == 409 and refused.body["error"] == "nothing to drain"
    assert waits == ["waited"]


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("::", "http://[::1]:30001"),
        ("::1", "http://[::1]:30001"),
        ("0.0.0.0", "http://127.0.0.1:30001"),
        ("fd00::5", "http://[fd00::5]:30001"),
        ("10.0.0.7", "http://10.0.0.7:30001"),
    ],
)
def test_the_links_sglang_url_is_bracketed_and_reachable(host: str, url: str) -> None:
    """The drain wait reads SGLang's /metrics at this URL: a wildcard or IPv6 bind must give
    a URL httpx can reach (`::` once gave `http://:::30001/metrics`)."""
    cfg = parse(
        "router:\n  url: http://10.0.0.5:30080\n  worker_url: http://w:1\n", host=f'"{host}"'
    )
    link = link_for(cfg, log=_Quiet(), metrics=Metrics(CollectorRegistry()))
    assert link is not None
    assert link.sglang_url == url
    assert httpx.URL(link.sglang_url + "/metrics").port == 30001


class _Quiet:
    def info(self, event: str, **kw: object) -> None:
        pass

    def warning(self, event: str, **kw: object) -> None:
        pass
