"""Serving quality against the stand-in, for what a CPU cannot show of real SGLang: speculation
that accepts nothing (spec_collapse, and the fallback relaunch), decode batches without CUDA
graphs (no_cuda_graph). The canary's gate and alert run here too (tests/realsglang holds the
same on the real server, with perturbed weights)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.quality import golden as canary_store
from testkit import base_config, running

pytestmark = pytest.mark.timeout(90)


def fault(name: str, launch: int | None = None) -> dict[str, Any]:
    env = {"STANDIN_FAULT": name}
    if launch is not None:
        env["STANDIN_FAULT_LAUNCH"] = str(launch)
    return {"env": env}


def degraded(d: Any, reason: str, timeout: float = 30.0) -> dict[str, Any]:
    return d.wait_for(
        lambda e: e.get("event") == "quality degraded" and e.get("reason") == reason,
        timeout,
        what=f"quality degraded {reason}",
    )


def poll(d: Any, pred: Any, timeout: float = 30.0) -> dict[str, Any]:
    """/status.quality once `pred` holds of it (each read is a real round trip)."""
    deadline = time.monotonic() + timeout
    while True:
        q: dict[str, Any] = d.status()["quality"]
        if pred(q):
            return q
        assert time.monotonic() < deadline, f"timed out; quality is {q}"
        time.sleep(0.1)


def test_canary_learns_then_gates_a_wrong_answer(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path,
        sglang=fault("wrong-answer", launch=2),
        restart={"crash_loop": {"max_restarts": 5, "window": "1h"}},
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        q = d.status()["quality"]
        assert q["canary"]["state"] == "learned"
        assert q["canary"]["checked_tokens"] == 16
        learned = q["canary"]["got"]
        goldens = canary_store.CanaryStore(str(tmp_path / "state" / "canary")).goldens()
        assert [g.answer.text for g in goldens] == [learned]
        assert d.post("/restart").status_code == 202
        # Launch 2 answers other tokens: never ready, restarted for canary_mismatch.
        assert d.wait_state("restarting")["reason"] == "manual"
        restart = d.wait_for(
            lambda e: e.get("event") == "state" and e.get("reason") == "canary_mismatch",
            what="canary_mismatch restart",
        )
        assert restart["new"] == "restarting"
        assert f"expected {learned!r}" in restart["detail"]
        # Launch 3 is healthy again and matches the golden learned on launch 1.
        d.wait_state("ready")
        st = d.status()
        assert st["quality"]["canary"]["state"] == "matched"
        assert st["last_restart"]["reason"] == "canary_mismatch"
        assert "expected" in st["last_restart"]["detail"]
        assert st["last_restart"]["incident"]
        states = d.states()
        manual = states.index("restarting")
        assert "ready" not in states[manual + 1 : states.index("restarting", manual + 1)]
        metrics = d.get("/metrics").text
        assert 'kimi_serve_restarts_total{reason="canary_mismatch"} 1.0' in metrics
        assert "kimi_serve_canary_ok 1.0" in metrics


def test_canary_gate_crash_loop_tries_the_fallback(tmp_path: Path) -> None:
    state = tmp_path / "state" / "canary"
    cfg = base_config(
        tmp_path,
        sglang=fault("wrong-answer", launch=None),
        restart={"crash_loop": {"max_restarts": 2, "window": "1h"}, "fallback_profile": "fallback"},
    )
    # A golden learned from the right answer by another daemon, serving a copy of the model
    # at another path: the golden is keyed by the files' content, not their path.
    (tmp_path / "a").mkdir()
    with running(tmp_path / "a", base_config(tmp_path / "a")) as good:
        good.wait_state("ready")
        src = Path(good.cfg["state_dir"]) / "canary"
        learned = good.status()["quality"]["canary"]["got"]
    state.mkdir(parents=True)
    for f in src.glob("golden-*.json"):
        (state / f.name).write_text(f.read_text())
    assert cfg["sglang"]["model_path"] != good.cfg["sglang"]["model_path"]
    # The fallback profile serves right (its own environment drops the fault).
    cfg["profiles"]["fallback"]["env"] = {"STANDIN_FAULT": None}
    with running(tmp_path, cfg) as d:
        d.wait_for(lambda e: e.get("event") == "profile changed", what="profile change")
        d.wait_state("ready")
        st = d.status()
        assert st["profile"] == "fallback"
        assert st["restarts"] == {"canary_mismatch": 2}
        # The fallback drops speculation: another layout, so a key of its own, verified
        # against the primary's golden before it is learned.
        (primary,) = [g.key for g in canary_store.CanaryStore(str(src)).goldens()]
        assert st["quality"]["canary"]["state"] == "learned"
        assert st["quality"]["canary"]["verified_against"] == primary
        assert st["quality"]["canary"]["expected"] == learned


def test_canary_alert_serves_and_reports(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path, sglang=fault("wrong-answer", launch=2), quality={"canary": {"policy": "alert"}}
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        assert d.post("/restart").status_code == 202
        d.wait_state("restarting")
        d.wait_state("ready")
        q = d.status()["quality"]
        assert q["canary"]["state"] == "mismatch"
        assert q["canary"]["expected"] != q["canary"]["got"]
        assert q["degraded"] == ["canary_mismatch"]
        metrics = d.get("/metrics").text
        assert "kimi_serve_canary_ok 0.0" in metrics
        assert 'kimi_serve_quality_degraded{reason="canary_mismatch"} 1.0' in metrics
        assert 'kimi_serve_restarts_total{reason="canary_mismatch"} 0.0' in metrics
        assert "quality: canary_mismatch" in d.status()["status_line"]


def test_spec_collapse_reported_without_restart(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path, sglang=fault("spec-collapse"))) as d:
        d.wait_state("ready")
        ev = degraded(d, "spec_collapse")
        assert "1.00" in ev["detail"]
        st = d.status()
        assert st["quality"]["spec_accept_length"] == pytest.approx(1.0)
        assert "spec_collapse" in st["quality"]["degraded"]
        assert st["state"] == "ready" and st["restarts"] == {}
        metrics = d.get("/metrics").text
        assert 'kimi_serve_quality_degraded{reason="spec_collapse"} 1.0' in metrics
        assert "kimi_serve_spec_accept_length 1.0" in metrics


def test_spec_healthy_is_not_a_collapse(tmp_path: Path) -> None:
    with running(tmp_path, base_config(tmp_path)) as d:
        d.wait_state("ready")
        # Liveness probes every 0.5 s; a collapse would need two judgements below the floor.
        q = poll(d, lambda q: len(q["evidence"]) > 0 and (q["spec_accept_length"] or 0) > 0)
        q = poll(d, lambda q: q["probes_judged"] >= 4)
        assert q["spec_accept_length"] == pytest.approx(8 / 3)
        assert "spec_collapse" not in q["degraded"]


def test_spec_collapse_falls_back(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path,
        sglang=fault("spec-collapse"),
        restart={"fallback_profile": "fallback"},
        quality={"on_spec_collapse": "fallback"},
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        restart = d.wait_for(
            lambda e: e.get("event") == "state" and e.get("reason") == "spec_collapse",
            what="spec_collapse restart",
        )
        assert "below the floor 1.3" in restart["detail"]
        d.wait_state("ready")
        st = d.status()
        assert st["profile"] == "fallback"
        assert st["last_restart"]["reason"] == "spec_collapse"
        assert st["last_restart"]["incident"]
        # Without speculation there is no accept length, and so no collapse.
        assert st["quality"]["spec_accept_length"] is None
        assert st["quality"]["degraded"] == []


def test_no_cuda_graph_reported(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path,
        sglang=fault("no-cuda-graph"),
        readiness={"probe": {"max_tokens": 40}},
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        ev = degraded(d, "no_cuda_graph")
        assert "cuda graph: False" in ev["detail"]
        st = d.status()
        assert st["quality"]["degraded"] == ["no_cuda_graph"]
        assert st["state"] == "ready" and st["restarts"] == {}


def test_no_cuda_graph_not_on_a_profile_that_disables_graphs(tmp_path: Path) -> None:
    cfg = base_config(
        tmp_path,
        sglang={**fault("no-cuda-graph"), "args": {"disable-cuda-graph": True}},
        readiness={"probe": {"max_tokens": 40}},
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        q = poll(d, lambda q: q["evidence"]["decode_batches_judged"] >= 4)
        assert q["evidence"]["graphs_expected"] is False
        assert q["degraded"] == []
