"""A keyed SGLang under the real daemon: `sglang.api_key_file`, one launch and one relaunch.

SGLang 0.5.23 refuses a request without the key (401) on every route but /health*, /ready*
and /metrics (srt/utils/auth.py:100-106), so the readiness probe must send it; and it logs its
server arguments, the key among them (srt/entrypoints/engine.py:1185), so what kimi-serve
forwards and keeps must not hold it. Neither may `ps` (docs/security.md, "Attacks").
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from testkit import realsglang as real
from testkit.realsglang import LOAD_TIMEOUT, Real, daemon_config, real_daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
# Two cores shared with other work: a launch took over 4 minutes under a load average of 9.
SLOW_LOAD = 3 * LOAD_TIMEOUT

KEY = "sk-" + secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def keyed(sgl: real.SGLangEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    tmp = tmp_path_factory.mktemp("real-api-key")
    key_file = tmp / "sglang.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    # A tail long enough to still hold the server arguments SGLang prints at start.
    cfg = daemon_config(
        tmp, sgl, logs={"tail_lines": 5000}, readiness={"load_timeout": f"{SLOW_LOAD:g}s"}
    )
    cfg["sglang"]["api_key_file"] = str(key_file)
    with real_daemon(tmp, cfg) as r:
        yield r


def every_command_line() -> Iterator[str]:
    """What `ps -ef` shows: every process's command line on this host."""
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            yield " ".join(proc.cmdline())


def test_a_keyed_sglang_gets_ready_and_its_key_is_in_no_command_line(keyed: Real) -> None:
    ready = keyed.wait_ready(SLOW_LOAD)
    assert ready["reason"] == "probe_ok", ready
    # The server is keyed: without the key it refuses, with it it answers.
    url = keyed.sglang_url
    assert httpx.get(url + "/server_info", timeout=10).status_code == 401
    keyed_answer = httpx.get(
        url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
    )
    assert keyed_answer.status_code == 200
    # The intent check fetched /server_info with the key too.
    assert keyed.d.status()["intent"]["checked"] is True
    main = keyed.d.sglang_pid()
    assert "--config" in psutil.Process(main).cmdline()
    assert not [c for c in every_command_line() if KEY in c]


def test_the_key_is_not_in_the_journal_but_the_server_arguments_are(keyed: Real) -> None:
    journal = "".join(keyed.d.raw)
    assert KEY not in journal
    # SGLang did print its arguments, the key among them: kimi-serve forwarded them redacted.
    forwarded = [
        json.loads(line)["event"]
        for line in keyed.d.raw
        if line.startswith("{") and "server_args=" in line
    ]
    assert forwarded and all("'api_key': '<redacted>'" in e for e in forwarded), forwarded[:1]


def test_a_relaunch_keeps_the_key_out_of_the_log_tail(keyed: Real) -> None:
    assert keyed.d.post("/restart").status_code == 202
    keyed.d.wait_state("restarting", 60)
    keyed.wait_ready(SLOW_LOAD)
    status = keyed.d.status()
    tail = status["last_restart"]["log_tail"]
    assert any("server_args=" in line for line in tail), tail[-5:]
    assert KEY not in json.dumps(status)
    secrets_file = Path(keyed.d.owner) / "sglang-secrets.yaml"
    assert secrets_file.stat().st_mode & 0o077 == 0
