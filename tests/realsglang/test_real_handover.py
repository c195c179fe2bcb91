"""A hand-over over the real SGLang 0.5.23 server, keyed (`sglang.api_key_file`, as production
runs it): `POST /reexec` while a client loop hammers `/readyz` on new connections and SGLang
itself, and a long generation streams. SGLang's PID is unchanged, nothing is relaunched,
`/readyz` never refused nor anything but 200, the generation and every request succeed, and
every access line SGLang printed reaches the log exactly once. The new daemon's probes carry the
key the launch was given: SGLang answers them (a keyless probe gets 401, srt/utils/auth.py), so
liveness probes keep passing after the hand-over, and the hand-over is `ok` only after one did.
"""

from __future__ import annotations

import concurrent.futures
import secrets
from pathlib import Path

import pytest

from testkit import realsglang as real
from testkit import wait_until
from testkit.handover import Hammer, access_lines, liveness
from testkit.realsglang import LOAD_TIMEOUT, daemon_config, generate, real_daemon, report

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_reexec_over_the_real_keyed_server(tmp_path: Path, sgl: real.SGLangEnv) -> None:
    key = "sk-" + secrets.token_urlsafe(24)
    key_file = tmp_path / "sglang.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    cfg = daemon_config(tmp_path, sgl)
    cfg["sglang"]["api_key_file"] = str(key_file)
    with real_daemon(tmp_path, cfg) as r:
        d = r.d
        d.wait_state("ready", timeout=LOAD_TIMEOUT)
        pid = d.sglang_pid()
        url = f"http://127.0.0.1:{cfg['sglang']['port']}"
        with Hammer(d.admin, url, key) as h, concurrent.futures.ThreadPoolExecutor(1) as pool:
            wait_until(lambda: h.sent > 10, 60, "the client loop running")
            streaming = pool.submit(generate, url, 256, key=key)
            assert d.post("/reexec").status_code == 202
            done = d.wait_for(lambda e: str(e.get("event")).startswith("hand-over"), timeout=120)
            while done["event"] != "hand-over complete":
                assert "cannot adopt" not in done["event"], done
                done = d.wait_for(lambda e: str(e.get("event")).startswith("hand-over"), 120)
            before = h.sent
            wait_until(lambda: h.sent > before + 10, 60, "the client loop after the hand-over")
            answer = streaming.result(timeout=300)
            # The new daemon's liveness probes pass: more of them than the failure threshold
            # (3) after the hand-over, and none failed.
            passed, failed = liveness(d)
            wait_until(lambda: liveness(d)[0] >= passed + 4, 120, "4 more liveness probes")
            assert liveness(d)[1] == failed == 0
        assert answer["meta_info"]["completion_tokens"] == 256
        assert set(h.codes) == {"200"}, h.codes
        assert h.failed == 0
        status = d.status()
        assert status["child"]["pid"] == pid
        assert status["state"] == "ready"
        assert status["daemon"]["last_handoff"]["outcome"] == "ok"
        assert not [e for e in d.seen if e.get("event") == "launched sglang"][1:]
        report("hand-over over the real server, exec to ready", float(done["seconds"]))
        assert d.stop() == 0
    seen = access_lines(d)
    assert [n for n in range(1, h.sent + 1) if seen[n] != 1] == [], seen
