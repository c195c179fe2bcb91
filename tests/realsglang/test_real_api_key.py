"""A keyed SGLang under the real daemon: `sglang.api_key_file`, one launch and one relaunch.

SGLang 0.5.23 refuses a request without the key (401) on every route but /health*, /ready*
and /metrics (srt/utils/auth.py:100-106), so the readiness probe must send it; and it logs its
server arguments, the key among them (srt/entrypoints/engine.py:1185), so what kimi-serve
forwards and keeps must not hold it. Neither may `ps` (docs/security.md, "Attacks").

The relaunch is the one a hang causes: the same daemon also shows the incident side on the real
server (the load timeline from its log markers, then its scheduler SIGSTOPped, which the
liveness probe catches, with py-spy stacks of every process taken before the kill), so both
share one daemon and two launches. The tests run in file order.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from testkit import realsglang as real
from testkit.observability import series_from_exposition
from testkit.realsglang import LOAD_TIMEOUT, Real, daemon_config, real_daemon, report

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
# Two cores shared with other work: a launch took over 4 minutes under a load average of 9.
SLOW_LOAD = 3 * LOAD_TIMEOUT

KEY = "sk-" + secrets.token_urlsafe(24)
# The incident of the hang test, read by the test after it.
HUNG: dict[str, Path] = {}


@pytest.fixture(scope="module")
def keyed(sgl: real.SGLangEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    tmp = tmp_path_factory.mktemp("real-api-key")
    key_file = tmp / "sglang.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    # A tail long enough to still hold the server arguments SGLang prints at start.
    cfg = daemon_config(
        tmp,
        sgl,
        logs={"tail_lines": 5000},
        readiness={"load_timeout": f"{SLOW_LOAD:g}s"},
        incidents={"dump_timeout": "30s"},
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


def _until_ready(r: Real, timeout: float) -> None:
    """`ready` now, whether or not an earlier test already saw it happen (run alone too)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError):  # the token and the endpoint come
            if r.d.status()["state"] == "ready":  # a moment after the daemon's start
                return
        assert time.monotonic() < deadline, f"not ready within {timeout:g}s"
        time.sleep(0.2)


def test_real_load_timeline_and_stacks_of_a_hung_server(keyed: Real) -> None:
    _until_ready(keyed, SLOW_LOAD)
    r = keyed
    status = r.d.status()
    metrics = r.d.get("/metrics").text
    load = status["last_load"]
    main = int(status["child"]["pid"])
    scheduler = r.pid_of("sglang::scheduler")
    detokenizer = r.pid_of("sglang::detokenizer")
    os.kill(scheduler, signal.SIGSTOP)  # frozen, as a scheduler stuck in a CUDA call is
    ev = r.d.wait_state("restarting", 60)
    taken = r.d.wait_for(lambda e: e.get("event") == "stacks taken before the kill", 60, "the dump")
    r.d.wait_for(lambda e: e.get("event") == "sglang restart", 60, "the restart")
    r.d.wait_state("cleaning", 60)
    last = r.d.status()["last_restart"]

    # The load, as 0.5.23 prints it on a CPU with --disable-cuda-graph (docs/sglang.md, "Load
    # markers"): no CUDA graph phase, and it is absent, not 0. Warmup is there although our
    # probe passes before SGLang's own warm-up prints its ready line: it ends at the earlier
    # of that line and the passing probe's start.
    assert load["complete"] is True, load
    assert {"init", "weights", "kv_cache", "warmup", "probe"} <= set(load["phases"]), load
    assert load["missing"] == ["cuda_graph"], load
    assert "cuda_graph" not in load["phases"]
    assert load["sglang_reported"], load  # SGLang's own "Engine startup timings" line
    phases = {n for n in series_from_exposition(metrics) if n == "kimi_serve_load_phase_seconds"}
    assert phases
    for phase, seconds in load["phases"].items():
        assert f'kimi_serve_load_phase_seconds{{phase="{phase}"}} {seconds}' in metrics
    assert 'phase="cuda_graph"' not in metrics
    for phase, seconds in load["phases"].items():
        report(f"real load phase {phase}", seconds)

    # The hang: a liveness restart, with every process's stack taken while it was alive.
    assert ev["reason"] == "liveness_failed"
    inc = Path(last["incident"])
    doc = json.loads((inc / "incident.json").read_text())
    assert doc["reason"] == "liveness_failed" and doc["stacks"]["taken"] is True
    by_pid = {p["pid"]: p for p in doc["stacks"]["processes"]}
    for pid in (main, scheduler, detokenizer):
        assert pid in by_pid and by_pid[pid]["ok"], doc["stacks"]
    text = (inc / "stacks.txt").read_text()
    # The scheduler's event loop, where a hung scheduler sits (scheduler.py's event_loop_*).
    assert "event_loop" in text, text[:3000]
    assert doc["server_info"]["version"].startswith("0.5.23")
    report("real stack dump before the kill", float(taken["seconds"]))
    HUNG["incident"] = inc


def test_the_incident_of_a_keyed_server_holds_no_key() -> None:
    assert HUNG, "the hang test did not run"
    inc = HUNG["incident"]
    leaked = [
        f.name for f in inc.rglob("*") if f.is_file() and KEY in f.read_text(errors="replace")
    ]
    assert not leaked, leaked


def test_a_relaunch_keeps_the_key_out_of_the_log_tail(keyed: Real) -> None:
    # The relaunch after the hang above (the tests run in file order).
    keyed.wait_ready(SLOW_LOAD)
    status = keyed.d.status()
    assert status["last_restart"] is not None, "the hang test did not run"
    tail = status["last_restart"]["log_tail"]
    assert any("server_args=" in line for line in tail), tail[-5:]
    assert KEY not in json.dumps(status)
    secrets_file = Path(keyed.d.owner) / "sglang-secrets.yaml"
    assert secrets_file.stat().st_mode & 0o077 == 0
