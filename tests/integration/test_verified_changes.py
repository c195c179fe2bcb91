"""Verified changes against the stand-in: the gate fails closed (a canary that never answers is
`canary_unavailable`, never ready), known answers gate a new key (a wrong first answer is never
learned), a changed key is verified against the previous key's golden, and `canary try`."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor import cli
from supervisor.quality import golden as canary_store
from testkit import base_config, running

pytestmark = pytest.mark.timeout(120)

# The stand-in answers its prompt's words, repeated: " alpha beta gamma alpha …".
KNOWN = [{"prompt": "alpha beta gamma", "expect": "alpha beta gamma alpha"}]


def _env(**env: str) -> dict[str, Any]:
    return {"env": env}


def _long_requests_hang(**env: str) -> dict[str, Any]:
    """Every request of 16 tokens or more hangs; the 8-token probes answer."""
    hang = {"STANDIN_FAULT": "decode-hang", "STANDIN_HANG_AFTER_DECODES": "0"}
    return _env(**hang, STANDIN_HANG_MIN_TOKENS="16", **env)


def _ready_before(states: list[str], end: str = "restarting") -> bool:
    """Whether `ready` came before the first `end`."""
    return "ready" in states[: states.index(end)] if end in states else "ready" in states


def test_long_requests_hang_short_probes_answer_never_ready(tmp_path: Path) -> None:
    # Every 16-token request hangs while 8-token probes answer: the canary never answers.
    cfg = base_config(
        tmp_path,
        sglang=_long_requests_hang(STANDIN_FAULT_LAUNCH="1"),
        readiness={"probe": {"timeout": "1s"}},
    )
    with running(tmp_path, cfg) as d:
        tries = [d.wait_reason("canary_unavailable", 30, new="warming") for _ in range(2)]
        assert "no canary answer within 1s (1/3)" in tries[0]["detail"]
        assert "(2/3)" in tries[1]["detail"]
        restart = d.wait_reason("canary_unavailable", 60)
        assert restart["new"] == "restarting" and "(3/3)" in restart["detail"]
        assert not _ready_before(d.states())
        d.wait_state("ready", 40)  # launch 2 has no fault
        st = d.status()
        assert st["last_restart"]["reason"] == "canary_unavailable"
        assert st["last_restart"]["incident"], "an incident, as for any unrequested restart"
        assert st["quality"]["canary"]["state"] == "learned"
        metrics = d.get("/metrics").text
        assert 'kimi_serve_restarts_total{reason="canary_unavailable"} 1.0' in metrics


def test_decode_hang_is_never_ready(tmp_path: Path) -> None:
    # The probe answers, then every decode hangs: the canary first, then the probes.
    cfg = base_config(
        tmp_path,
        sglang=_env(
            STANDIN_FAULT="decode-hang", STANDIN_HANG_AFTER_DECODES="1", STANDIN_FAULT_LAUNCH="1"
        ),
        readiness={"probe": {"timeout": "1s"}},
    )
    with running(tmp_path, cfg) as d:
        d.wait_reason("canary_unavailable", 30)
        d.wait_state("restarting", 30)
        assert not _ready_before(d.states())
        d.wait_state("ready", 40)
        assert d.status()["last_restart"]["reason"] in ("canary_unavailable", "readiness_failed")


def test_alert_is_ready_without_a_canary_answer(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path,
        sglang=_long_requests_hang(),
        readiness={"probe": {"timeout": "1s"}},
        quality={"canary": {"policy": "alert"}},
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready", 30)
        q = d.status()["quality"]
        assert q["canary"]["state"] == "unknown" and "no canary answer" in q["canary"]["error"]


def test_a_wrong_first_answer_is_caught_by_the_known_answers_not_learned(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path,
        sglang=_env(STANDIN_FAULT="wrong-answer", STANDIN_FAULT_LAUNCH="1"),
        quality={"known_answers": KNOWN},
    )
    store = canary_store.CanaryStore(str(tmp_path / "state" / "canary"))
    with running(tmp_path, cfg) as d:
        restart = d.wait_reason("canary_mismatch", 60)
        assert "known answer to 'alpha beta gamma' fails" in restart["detail"]
        assert store.goldens() == [], "the wrong answer is never learned"
        last = store.last()
        assert last is not None and not last.known_ok
        d.wait_state("ready", 40)
        q = d.status()["quality"]
        assert q["canary"]["state"] == "learned"
        assert [k["ok"] for k in q["canary"]["known_answers"]] == [True]
        (golden,) = store.goldens()
        assert golden.known_ok and golden.answer.text == q["canary"]["got"]


def test_a_changed_key_is_verified_against_the_previous_golden(tmp_path: Path) -> None:
    store = canary_store.CanaryStore(str(tmp_path / "state" / "canary"))
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        (old,) = store.goldens()
    # Another SGLang version that answers right: verified, then learned.
    cfg["sglang"]["env"]["STANDIN_SGLANG_VERSION"] = "0.5.24"
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        q = d.status()["quality"]
        assert q["canary"]["state"] == "learned"
        assert q["canary"]["verified_against"] == old.key
    new = next(g for g in store.goldens() if g.key != old.key)
    assert new.sglang_version == "0.5.24" and new.verified_against == old.key
    # Another version again, answering wrong: canary_mismatch naming what changed.
    cfg["sglang"]["env"].update(STANDIN_SGLANG_VERSION="0.5.25", STANDIN_FAULT="wrong-answer")
    with running(tmp_path, cfg) as d:
        restart = d.wait_reason("canary_mismatch", 60)
        assert "SGLang 0.5.24 -> 0.5.25 changed" in restart["detail"]
        assert f"the golden of {new.key}" in restart["detail"]
        assert not any(g.sglang_version == "0.5.25" for g in store.goldens())


def test_canary_try_prints_the_known_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = [*KNOWN, {"prompt": "one two", "expect": "three"}]
    cfg = base_config(tmp_path, quality={"known_answers": wrong}, logging={"format": "json"})
    path = tmp_path / "try.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with running(tmp_path, base_config(tmp_path, sglang={"port": cfg["sglang"]["port"]})) as d:
        d.wait_state("ready")
        assert cli.main(["canary", "try", "--config", str(path)]) == 1  # one fails
        out = capsys.readouterr().out
        assert "ok   known answer to 'alpha beta gamma' holds" in out
        assert "FAIL known answer to 'one two' fails: expected 'three', got ' one two one two" in (
            out
        )
        assert cli.main(["canary", "try", "--json", "--config", str(path)]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert [k["ok"] for k in doc["known_answers"]] == [True, False]
        assert doc["canary"]["got"].startswith(" The quick brown fox")


def test_a_mismatch_records_the_known_answers_and_accept_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = base_config(
        tmp_path,
        sglang=_env(STANDIN_FAULT="wrong-answer", STANDIN_FAULT_LAUNCH="2"),
        quality={"known_answers": KNOWN},
    )
    store = canary_store.CanaryStore(str(tmp_path / "state" / "canary"))
    path = tmp_path / "accept.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        (golden,) = store.goldens()
        assert d.post("/restart").status_code == 202
        d.wait_reason("canary_mismatch", 60)  # launch 2: the same key, another answer
        last = store.last()
        assert last is not None and last.key == golden.key
        assert [k.ok for k in last.known] == [False], "asked, for accept to show"
        assert cli.main(["canary", "accept", "--yes", "--config", str(path)]) == 1
        captured = capsys.readouterr()
        assert "FAIL known answer to 'alpha beta gamma' fails" in captured.out
        assert "refused" in captured.err
        assert store.golden(golden.key) == golden
