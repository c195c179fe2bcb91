"""The last known good's store, comparison and trusted command (supervisor/daemon/upgrades.py):
what differs, what a rollback may launch, what a file the service user can write cannot do."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from supervisor.config import Config
from supervisor.core.context import Context
from supervisor.core.events import RecordLkg
from supervisor.core.states import TrialVerdict, UpgradeState
from supervisor.daemon import upgrades
from supervisor.daemon.upgrades import Print, Record, Upgrades
from supervisor.sglang import argv as command
from testkit.machine import CFG


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}\n")
    sglang = dataclasses.replace(CFG.sglang, model_path=str(model))
    return dataclasses.replace(CFG, state_dir=str(tmp_path / "state"), sglang=sglang)


@pytest.fixture
def version(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """What each interpreter reports (no subprocess): edit it to upgrade a venv in place."""
    reported: dict[str, str] = {}
    monkeypatch.setattr(upgrades, "sglang_version", lambda python: reported.get(python, "0.5.23"))
    return reported


def _record(up: Upgrades, cfg: Config, tps: float = 90.0) -> None:
    spec = command.build(cfg)
    asyncio.run(up.record(RecordLkg(1, "primary", tps, 2.5), spec, "served 600s"))


def _compare(up: Upgrades, cfg: Config):  # type: ignore[no-untyped-def]
    return asyncio.run(up.compare(2, command.build(cfg)))


def test_a_first_launch_is_no_trial(cfg: Config, version: dict[str, str]) -> None:
    got = _compare(Upgrades(cfg), cfg)
    assert got.has_lkg is False and got.differs == ()


def test_the_same_launch_is_no_trial_and_may_be_rolled_back_to(
    cfg: Config, version: dict[str, str]
) -> None:
    up = Upgrades(cfg)
    _record(up, cfg)
    got = _compare(up, cfg)
    assert got.has_lkg and got.differs == () and got.refusal is None
    assert (got.lkg_tps, got.lkg_accept) == (90.0, 2.5)


def test_what_differs_is_said(cfg: Config, version: dict[str, str]) -> None:
    up = Upgrades(cfg)
    _record(up, cfg)
    sglang = dataclasses.replace(
        cfg.sglang, python="/opt/sglang-0.5.24/bin/python", env={"NCCL_DEBUG": "INFO"}
    )
    version["/opt/sglang-0.5.24/bin/python"] = "0.5.24"
    new = dataclasses.replace(cfg, sglang=sglang)
    got = _compare(up, new)
    joined = "; ".join(got.differs)
    assert "SGLang 0.5.23 -> 0.5.24" in joined
    assert "interpreter" in joined and "env: NCCL_DEBUG" in joined
    assert got.refusal is None, "the old venv is still there, unchanged"


def test_a_venv_upgraded_in_place_cannot_be_rolled_back_to(
    cfg: Config, version: dict[str, str]
) -> None:
    up = Upgrades(cfg)
    _record(up, cfg)
    version[cfg.sglang.python] = "0.5.24"
    got = _compare(up, cfg)
    assert "SGLang 0.5.23 -> 0.5.24" in got.differs
    assert got.refusal is not None and "upgraded in place" in got.refusal


def test_model_files_changed_in_place_cannot_be_rolled_back_to(
    cfg: Config, version: dict[str, str]
) -> None:
    up = Upgrades(cfg)
    _record(up, cfg)
    (Path(cfg.sglang.model_path) / "model.safetensors").write_bytes(b"new weights")
    got = _compare(up, cfg)
    assert any(d.startswith("model files") for d in got.differs)
    assert got.refusal is not None and "changed in place" in got.refusal


def test_after_a_restart_only_the_config_that_builds_the_stored_command_is_trusted(
    cfg: Config, version: dict[str, str]
) -> None:
    _record(Upgrades(cfg), cfg)
    same = Upgrades(cfg)
    known = same.load()
    assert [(k.profile, k.tps) for k in known] == [("primary", 90.0)]
    assert same.spec_for("primary") == command.build(cfg)
    changed = dataclasses.replace(cfg, sglang=dataclasses.replace(cfg.sglang, env={"X": "1"}))
    other = Upgrades(changed)
    other.load()
    assert other.spec_for("primary") is None
    got = _compare(other, changed)
    assert got.differs and got.refusal is not None and "root-owned" in got.refusal


@pytest.mark.parametrize(
    "doc",
    [
        "not json",
        "[]",
        '{"profiles": []}',
        '{"profiles": {"primary": {"print": {"profile": "fallback"}}}}',
        '{"profiles": {"primary": 1}}',
    ],
)
def test_a_store_that_is_not_one_is_no_lkg(cfg: Config, doc: str) -> None:
    d = upgrades.store_dir(cfg.state_dir)
    d.mkdir(parents=True)
    (d / upgrades.STORE_FILE).write_text(doc)
    up = Upgrades(cfg)
    assert up.load() == [] and up.records == {}


def test_a_stored_record_round_trips_and_rejects_wrong_types(
    cfg: Config, version: dict[str, str]
) -> None:
    up = Upgrades(cfg)
    _record(up, cfg)
    rec = up.records["primary"]
    assert Record.from_json(json.loads(json.dumps(rec.to_json()))) == rec
    bad = rec.to_json()
    for key, value in (("argv", "python -m x"), ("env", {"A": 1}), ("python", None)):
        doc = {**bad, "print": {**bad["print"], key: value}}
        assert Record.from_json(doc) is None, key
    for key, value in (("at", True), ("at", float("nan")), ("launch", "1")):
        assert Record.from_json({**bad, key: value}) is None, key
    assert Record.from_json({**bad, "tps": "fast"}) == dataclasses.replace(rec, tps=None)
    assert Print.from_json(None) is None


def test_the_trial_state_travels_across_a_hand_over(cfg: Config, version: dict[str, str]) -> None:
    up = Upgrades(cfg)
    _record(up, cfg)
    ctx = Context(launch=3, on_lkg=True, trial=False, awaiting_lkg=True, gate_tps=80.0)
    ctx.upgrade, ctx.lkgs = UpgradeState.ROLLED_BACK, {"primary": (90.0, 2.5)}
    doc = json.loads(json.dumps(upgrades.carried(ctx, up)))
    fresh, up2 = Context(), Upgrades(cfg)
    upgrades.restore(fresh, up2, doc)
    assert fresh.on_lkg and fresh.awaiting_lkg and fresh.gate_tps == 80.0
    assert fresh.upgrade is UpgradeState.ROLLED_BACK
    assert fresh.lkgs == {"primary": (90.0, 2.5)}
    assert up2.spec_for("primary") == up.spec_for("primary")


def test_status_shows_the_trials_verdict_and_a_hand_over_keeps_it(cfg: Config) -> None:
    up = Upgrades(cfg)
    ctx = Context(launch=4, trial=True, ready_at=10.0, verdict=TrialVerdict.INCONCLUSIVE)
    ctx.upgrade, ctx.rolled_back = UpgradeState.TRIAL, "primary"
    trial = up.status_document(ctx, 70.0)["trial"]
    assert trial["verdict"] == "inconclusive" and trial["served_s"] == 60.0
    doc = json.loads(json.dumps(upgrades.carried(ctx, up)))
    fresh = Context()
    upgrades.restore(fresh, Upgrades(cfg), doc)
    assert fresh.verdict is TrialVerdict.INCONCLUSIVE and fresh.rolled_back == "primary"
    before_gate = Context(trial=True)
    assert up.status_document(before_gate, 0.0)["trial"]["verdict"] is None


def test_an_older_daemons_state_judges_nothing_again() -> None:
    fresh = Context()
    upgrades.restore(fresh, Upgrades(CFG), None)
    assert fresh.compared is True and fresh.trial is False
