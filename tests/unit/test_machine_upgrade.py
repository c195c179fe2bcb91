"""Trials and the last known good in the machine (core/upgrade_rules.py): the gate waits for the
comparison, a trial is judged there, a launch that served quality.trial_period becomes the LKG,
and a regression rolls back, holds or is reported (quality.on_trial_regression)."""

from __future__ import annotations

import dataclasses

import pytest

from supervisor.config import Config
from supervisor.core import machine as core
from testkit.machine import (
    CFG,
    FALLBACK,
    PID,
    Drive,
    failed_result,
    make_cfg,
    of,
    ok_result,
    transitions,
)

PERIOD = CFG.quality.trial_period
LKG_TPS = 100.0
LKG_ACCEPT = 3.0


def with_quality(cfg: Config = CFG, **quality: object) -> Config:
    return dataclasses.replace(cfg, quality=dataclasses.replace(cfg.quality, **quality))


def gate(
    d: Drive,
    tps: float | None = LKG_TPS,
    accept: float | None = LKG_ACCEPT,
    busy: bool = False,
    mismatch: str | None = None,
    known: bool = False,
    steps: int = 3,
) -> list[core.Action]:
    result = dataclasses.replace(ok_result(), spec_verify_ct=steps)
    done = core.ProbeDone(
        d.launch,
        core.ProbeKind.READINESS,
        result,
        busy,
        canary_mismatch=mismatch,
        gate_tps=tps,
        gate_accept=accept,
        known_failed=known,
    )
    return d.send(done, after=1)


def to_warming(d: Drive) -> list[core.Action]:
    """CLEANING to WARMING; the actions of the Launch step."""
    d.expect(core.State.CLEANING)
    actions = d.send(core.HostReady())
    d.send(core.Launched(d.launch, PID), after=0.1)
    d.send(core.PortOpen(d.launch), after=60)
    d.expect(core.State.WARMING)
    return actions


def compared(
    d: Drive, *differs: str, refusal: str | None = None, has_lkg: bool = True
) -> list[core.Action]:
    return d.send(core.LaunchCompared(d.launch, has_lkg, differs, LKG_TPS, LKG_ACCEPT, refusal))


def with_lkg(cfg: Config = CFG) -> Drive:
    d = Drive(cfg)
    d.send(core.LkgKnown(core.PRIMARY, LKG_TPS, LKG_ACCEPT))
    d.cleaning()
    return d


def trial_at_gate(cfg: Config = CFG, refusal: str | None = None) -> Drive:
    d = with_lkg(cfg)
    to_warming(d)
    upgrade = of(core.UpgradeChanged, compared(d, "SGLang 0.5.23 -> 0.5.24", refusal=refusal))
    assert upgrade and upgrade[-1].state is core.UpgradeState.TRIAL
    return d


def served(d: Drive, seconds: float) -> list[core.Action]:
    """OK liveness probes over `seconds`; every action they brought."""
    actions: list[core.Action] = []
    step = d.cfg.liveness.interval
    for _ in range(int(seconds // step) + 1):
        actions += d.liveness(ok_result(), after=step)
    return actions


def test_a_first_launch_becomes_the_last_known_good_after_its_trial_period() -> None:
    d = Drive(CFG).ready()
    early = served(d, PERIOD - 2 * CFG.liveness.interval)
    assert not of(core.RecordLkg, early)
    later = served(d, 2 * CFG.liveness.interval)
    (record,) = of(core.RecordLkg, later)
    assert record.profile == core.PRIMARY and record.launch == d.launch
    assert d.m.ctx.upgrade is core.UpgradeState.ACCEPTED
    assert not of(core.RecordLkg, served(d, PERIOD)), "promoted once"


def test_a_degraded_launch_is_promoted_at_its_next_good_probe_in_ready() -> None:
    d = Drive(CFG).ready()
    served(d, PERIOD - 3 * CFG.liveness.interval)
    d.liveness(failed_result(), after=CFG.liveness.interval * 2)
    d.expect(core.State.DEGRADED)
    back = d.liveness(ok_result())
    assert transitions(back) == [(core.State.DEGRADED, core.State.READY)]
    assert of(core.RecordLkg, back)


def test_the_gate_waits_for_the_comparison_when_the_profile_has_an_lkg() -> None:
    d = with_lkg()
    to_warming(d)
    waiting = gate(d)
    d.expect(core.State.WARMING)
    assert any(
        isinstance(a, core.SetTimer) and a.name is core.TimerName.PROBE_RETRY for a in waiting
    )
    compared(d)
    gate(d)
    d.expect(core.State.READY)
    assert d.m.ctx.trial is False
    assert not of(core.RecordLkg, served(d, PERIOD * 2)), "the LKG itself is not recorded again"


@pytest.mark.parametrize(
    ("readings", "regression"),
    [
        ({"tps": 0.7 * LKG_TPS}, core.Regression.SPEED),
        ({"accept": 1.0, "steps": 8}, core.Regression.ACCEPT_LENGTH),
        ({"mismatch": "expected 'Paris' got 'zzz'"}, core.Regression.CANARY),
        ({"mismatch": "'2+2' begins 'five'", "known": True}, core.Regression.KNOWN_ANSWERS),
    ],
)
def test_a_regressed_trial_is_rolled_back_to_the_lkg(
    readings: dict[str, object], regression: core.Regression
) -> None:
    d = trial_at_gate()
    actions = gate(d, **readings)  # type: ignore[arg-type]
    (rolled,) = of(core.RolledBack, actions)
    assert rolled.regression is regression
    assert transitions(actions) == [(core.State.WARMING, core.State.RESTARTING)]
    assert not of(core.NotifyReady, actions), "no client is ever served by the trial"
    restart = of(core.RecordRestart, d.send(core.ChildGone(d.launch, None, 15), after=2))
    assert restart[0].reason is core.Reason.TRIAL_REGRESSED
    d.expect(core.State.CLEANING)  # at once: neither backed off nor counted
    assert not d.m.ctx.restarts
    (launch,) = of(core.Launch, d.send(core.HostReady()))
    assert launch.lkg is True
    upgrade = of(core.UpgradeChanged, compared(d, "SGLang 0.5.23 -> 0.5.24"))
    assert upgrade[-1].state is core.UpgradeState.ROLLED_BACK
    assert d.m.ctx.trial is False


def test_a_rolled_back_host_stays_on_the_lkg_through_a_restart_until_a_reload() -> None:
    d = trial_at_gate()
    gate(d, tps=1.0)
    d.send(core.ChildGone(d.launch, None, 15), after=2)
    d.send(core.HostReady())
    d.send(core.Launched(d.launch, PID), after=0.1)
    d.send(core.PortOpen(d.launch), after=60)
    compared(d, "SGLang 0.5.23 -> 0.5.24")
    gate(d)
    d.expect(core.State.READY)
    d.send(core.RestartRequested(core.Reason.MANUAL))
    d.send(core.ChildGone(d.launch, 0, None), after=2)
    (again,) = of(core.Launch, d.send(core.HostReady()))
    assert again.lkg is True, "restart relaunches the LKG"
    d.send(core.Launched(d.launch, PID), after=0.1)
    d.send(core.PortOpen(d.launch), after=60)
    compared(d, "SGLang 0.5.23 -> 0.5.24")
    gate(d)
    d.send(core.ReloadRequested())
    reload = d.send(core.ConfigRead(core.Verdict.UNCHANGED))
    assert transitions(reload) == [(core.State.READY, core.State.RESTARTING)], (
        "an unchanged reload after a rollback is a new trial"
    )
    d.send(core.ChildGone(d.launch, 0, None), after=2)
    (fresh,) = of(core.Launch, d.send(core.HostReady()))
    assert fresh.lkg is False


def test_a_short_answers_coarse_accept_length_is_no_regression() -> None:
    # 8 tokens in 4 verify steps read 2.0 against the LKG's 3.0 (8 in 3 would be 2.67): one
    # step of quantization, not a draft model that fits worse.
    d = trial_at_gate()
    actions = gate(d, accept=2.0, steps=4)
    assert not of(core.RolledBack, actions)
    d.expect(core.State.READY)


def test_a_busy_gate_gives_no_speed_verdict() -> None:
    d = trial_at_gate()
    actions = gate(d, tps=1.0, busy=True)
    assert not of(core.RolledBack, actions)
    d.expect(core.State.READY)


def test_hold_keeps_a_regressed_trial_from_ever_being_ready() -> None:
    d = trial_at_gate(with_quality(on_trial_regression="hold"))
    actions = gate(d, tps=1.0)
    assert not of(core.RolledBack, actions) and not of(core.NotifyReady, actions)
    assert of(core.UpgradeChanged, actions)[-1].state is core.UpgradeState.HELD
    gone = d.send(core.ChildGone(d.launch, None, 15), after=2)
    assert transitions(gone)[-1] == (core.State.RESTARTING, core.State.FAILED)


REFUSAL = "its interpreter now reports SGLang 0.5.24"


@pytest.mark.parametrize(
    "readings",
    [
        {"mismatch": "expected 'Paris' got 'zzz'"},
        {"mismatch": "'2+2' begins 'five'", "known": True},
    ],
)
def test_a_wrong_answer_without_a_verifiable_lkg_is_the_gates_canary_mismatch(
    readings: dict[str, object],
) -> None:
    d = trial_at_gate(refusal=REFUSAL)
    actions = gate(d, **readings)  # type: ignore[arg-type]
    assert not of(core.RolledBack, actions) and not of(core.NotifyReady, actions)
    assert transitions(actions) == [(core.State.WARMING, core.State.RESTARTING)]
    assert of(core.Transitioned, actions)[0].reason is core.Reason.CANARY_MISMATCH
    assert REFUSAL in of(core.UpgradeChanged, actions)[-1].why
    gone = d.send(core.ChildGone(d.launch, None, 15), after=2)
    assert of(core.RecordRestart, gone)[0].reason is core.Reason.CANARY_MISMATCH
    d.expect(core.State.RESTARTING)  # backed off and counted: the fallback profile, then failed
    assert len(d.m.ctx.restarts) == 1
    assert d.m.ctx.upgrade is not core.UpgradeState.HELD


@pytest.mark.parametrize(
    ("readings", "regression"),
    [
        ({"tps": 0.7 * LKG_TPS}, core.Regression.SPEED),
        ({"accept": 1.0, "steps": 8}, core.Regression.ACCEPT_LENGTH),
    ],
)
def test_a_slower_trial_without_a_verifiable_lkg_serves_regressed_never_promoted(
    readings: dict[str, object], regression: core.Regression
) -> None:
    d = trial_at_gate(refusal=REFUSAL)
    actions = gate(d, **readings)  # type: ignore[arg-type]
    d.expect(core.State.READY)
    assert of(core.NotifyReady, actions) and not of(core.RolledBack, actions)
    upgrade = of(core.UpgradeChanged, actions)[-1]
    assert upgrade.state is core.UpgradeState.REGRESSED
    assert str(regression) in upgrade.why and REFUSAL in upgrade.why
    assert d.m.ctx.verdict is core.TrialVerdict.REGRESSED
    assert not of(core.RecordLkg, served(d, PERIOD * 2)), "never the last known good"
    assert d.m.ctx.upgrade is core.UpgradeState.REGRESSED


def test_hold_without_a_verifiable_lkg_is_still_never_ready() -> None:
    d = trial_at_gate(with_quality(on_trial_regression="hold"), refusal=REFUSAL)
    actions = gate(d, tps=1.0)
    assert not of(core.NotifyReady, actions)
    assert of(core.UpgradeChanged, actions)[-1].state is core.UpgradeState.HELD
    d.send(core.ChildGone(d.launch, None, 15), after=2)
    d.expect(core.State.FAILED)


def test_alert_serves_a_regressed_trial_and_never_promotes_it() -> None:
    d = trial_at_gate(with_quality(on_trial_regression="alert"))
    actions = gate(d, tps=1.0)
    d.expect(core.State.READY)
    notes = [t for t in of(core.Transitioned, actions) if t.old is t.new]
    assert notes and notes[0].reason is core.Reason.TRIAL_REGRESSED
    assert not of(core.RecordLkg, served(d, PERIOD * 2))


def test_a_healthy_trial_becomes_the_lkg_with_its_own_readings() -> None:
    d = trial_at_gate()
    gate(d, tps=0.9 * LKG_TPS, accept=0.9 * LKG_ACCEPT)
    d.expect(core.State.READY)
    (record,) = of(core.RecordLkg, served(d, PERIOD + CFG.liveness.interval))
    assert (record.tps, record.accept) == (0.9 * LKG_TPS, 0.9 * LKG_ACCEPT)
    assert d.m.ctx.lkgs[core.PRIMARY] == (0.9 * LKG_TPS, 0.9 * LKG_ACCEPT)


def test_an_operator_accepts_a_serving_trial_at_once() -> None:
    d = trial_at_gate()
    gate(d)
    assert d.m.upgrade_refusal(core.UpgradeOp.ACCEPT) is None
    (record,) = of(core.RecordLkg, d.send(core.UpgradeRequested(core.UpgradeOp.ACCEPT)))
    assert record.launch == d.launch
    assert d.m.upgrade_refusal(core.UpgradeOp.ACCEPT) is not None, "nothing left to accept"


def test_an_operator_rolls_back_a_serving_trial() -> None:
    d = trial_at_gate()
    gate(d)
    actions = d.send(core.UpgradeRequested(core.UpgradeOp.ROLLBACK))
    assert of(core.RolledBack, actions)[0].regression is core.Regression.MANUAL
    assert transitions(actions) == [(core.State.READY, core.State.RESTARTING)]
    d.send(core.ChildGone(d.launch, 0, None), after=2)
    assert of(core.Launch, d.send(core.HostReady()))[0].lkg is True


def test_upgrade_requests_are_refused_without_anything_to_act_on() -> None:
    d = Drive(CFG).ready()
    assert "no last known good" in (d.m.upgrade_refusal(core.UpgradeOp.ROLLBACK) or "")
    assert d.m.upgrade_refusal(core.UpgradeOp.ACCEPT) is not None
    assert d.send(core.UpgradeRequested(core.UpgradeOp.ROLLBACK)) == []
    d.expect(core.State.READY)


def test_accept_after_a_rollback_launches_the_config_and_takes_it() -> None:
    d = trial_at_gate()
    gate(d, tps=1.0)
    d.send(core.ChildGone(d.launch, None, 15), after=2)
    d.send(core.HostReady())
    d.send(core.Launched(d.launch, PID), after=0.1)
    d.send(core.PortOpen(d.launch), after=60)
    compared(d, "SGLang 0.5.23 -> 0.5.24")
    gate(d)
    d.send(core.UpgradeRequested(core.UpgradeOp.ACCEPT))
    d.send(core.ChildGone(d.launch, 0, None), after=2)
    assert of(core.Launch, d.send(core.HostReady()))[0].lkg is False
    d.send(core.Launched(d.launch, PID), after=0.1)
    d.send(core.PortOpen(d.launch), after=60)
    compared(d, "SGLang 0.5.23 -> 0.5.24")
    actions = gate(d, tps=1.0)
    d.expect(core.State.READY)
    assert of(core.RecordLkg, actions), "accepted: taken as it is, not judged"


def crash_loop(d: Drive) -> list[core.Action]:
    actions: list[core.Action] = []
    for _ in range(d.cfg.restart.crash_loop.max_restarts):
        d.send(core.ChildExited(d.launch, 1, None), after=1)
        actions = d.send(core.ChildGone(d.launch, 1, None))
        if d.state is not core.State.RESTARTING or of(core.RolledBack, actions):
            break
        d.backoff_elapsed(after=600)
        d.send(core.HostReady())
        d.send(core.Launched(d.launch, PID), after=0.1)
        compared(d, "SGLang 0.5.23 -> 0.5.24")
    return actions


def test_a_crash_looping_trial_is_rolled_back_before_the_fallback_profile() -> None:
    d = with_lkg()
    d.send(core.HostReady())
    d.send(core.Launched(d.launch, PID), after=0.1)
    compared(d, "SGLang 0.5.23 -> 0.5.24")
    actions = crash_loop(d)
    (rolled,) = of(core.RolledBack, actions)
    assert rolled.regression is core.Regression.CRASH_LOOP
    assert not of(core.ProfileChanged, actions)
    d.backoff_elapsed(after=600)
    (launch,) = of(core.Launch, d.send(core.HostReady()))
    assert launch.lkg is True and launch.profile == core.PRIMARY


def crash(d: Drive) -> list[core.Action]:
    d.send(core.ChildExited(d.launch, 1, None), after=1)
    return d.send(core.ChildGone(d.launch, 1, None))


def relaunch(d: Drive, *differs: str, has_lkg: bool = True) -> core.Launch:
    """After the backoff: the next launch, compared (what the effect would say)."""
    d.backoff_elapsed(after=600)
    (launch,) = of(core.Launch, d.send(core.HostReady()))
    d.send(core.Launched(d.launch, PID), after=0.1)
    compared(d, *differs, has_lkg=has_lkg)
    return launch


def test_a_crash_looping_lkg_goes_to_the_fallback_profile_then_fails_never_the_trial() -> None:
    d = with_lkg()
    d.send(core.HostReady())
    d.send(core.Launched(d.launch, PID), after=0.1)
    compared(d, "SGLang 0.5.23 -> 0.5.24")
    assert of(core.RolledBack, crash_loop(d))
    n = CFG.restart.crash_loop.max_restarts
    for _ in range(n):
        launch = relaunch(d, "SGLang 0.5.23 -> 0.5.24")
        assert (launch.profile, launch.lkg) == (core.PRIMARY, True), "the LKG, never the trial"
        gone = crash(d)
    assert of(core.ProfileChanged, gone) == [core.ProfileChanged(core.PRIMARY, FALLBACK)]
    d.expect(core.State.RESTARTING)
    assert d.m.ctx.on_lkg is False, "the fallback profile runs its config"
    for i in range(n):
        launch = relaunch(d, has_lkg=False)
        assert (launch.profile, launch.lkg) == (FALLBACK, False)
        gone = crash(d)
        if i < n - 1:
            d.expect(core.State.RESTARTING)
    d.expect(core.State.FAILED)
    assert not of(core.RolledBack, gone)
    refused = d.m.upgrade_refusal(core.UpgradeOp.ROLLBACK) or ""
    assert "fallback profile" in refused, "a rollback is of primary's launch, after a restart"
    # An operator's restart goes back to primary: still the last known good, not the trial.
    d.send(core.RestartRequested(core.Reason.MANUAL))
    (again,) = of(core.Launch, d.send(core.HostReady()))
    assert (again.profile, again.lkg) == (core.PRIMARY, True)


def test_a_crash_looping_lkg_without_a_fallback_profile_fails() -> None:
    d = with_lkg(make_cfg(fallback=None))
    d.send(core.HostReady())
    d.send(core.Launched(d.launch, PID), after=0.1)
    compared(d, "SGLang 0.5.23 -> 0.5.24")
    crash_loop(d)
    d.backoff_elapsed(after=600)
    d.send(core.HostReady())
    d.send(core.Launched(d.launch, PID), after=0.1)
    compared(d, "SGLang 0.5.23 -> 0.5.24")
    final = crash_loop(d)
    d.expect(core.State.FAILED)
    assert "the last known good" in of(core.Transitioned, final)[-1].detail


def test_fallback_launches_are_compared_only_with_a_fallback_lkg() -> None:
    d = with_lkg(make_cfg())
    d.send(core.HostReady())
    d.send(core.Launched(d.launch, PID), after=0.1)
    compared(d, has_lkg=True)  # the primary profile is the LKG itself: no trial
    for _ in range(CFG.restart.crash_loop.max_restarts):
        d.send(core.ChildExited(d.launch, 1, None), after=1)
        d.send(core.ChildGone(d.launch, 1, None))
        d.backoff_elapsed(after=600)
        d.send(core.HostReady())
        d.send(core.Launched(d.launch, PID), after=0.1)
        if d.m.ctx.profile == FALLBACK:
            break
        compared(d)
    assert d.m.ctx.profile == FALLBACK
    assert d.m.ctx.compared is True, "no fallback LKG: nothing to wait for"


def test_a_regressed_node_of_a_group_leaves_the_rollback_to_the_group() -> None:
    d = trial_at_gate(make_cfg(mode="exit"))
    actions = gate(d, tps=1.0)
    assert not of(core.RolledBack, actions)
    gone = d.send(core.ChildGone(d.launch, None, 15), after=2)
    (stop,) = transitions(gone)
    assert stop == (core.State.RESTARTING, core.State.STOPPING)
    assert of(core.RecordRestart, gone)[0].reason is core.Reason.TRIAL_REGRESSED


@pytest.mark.parametrize(
    ("readings", "verdict"),
    [
        ({}, core.TrialVerdict.PASS),
        ({"tps": 0.7 * LKG_TPS}, core.TrialVerdict.REGRESSED),
        ({"tps": 0.7 * LKG_TPS, "busy": True}, core.TrialVerdict.INCONCLUSIVE),
        ({"tps": LKG_TPS, "busy": True}, core.TrialVerdict.INCONCLUSIVE),
        ({"accept": 1.0, "steps": 8, "busy": True}, core.TrialVerdict.INCONCLUSIVE),
        ({"mismatch": "expected 'Paris' got 'zzz'", "busy": True}, core.TrialVerdict.REGRESSED),
    ],
)
def test_the_trials_verdict_at_its_gate(
    readings: dict[str, object], verdict: core.TrialVerdict
) -> None:
    # alert: the trial serves whatever its verdict, so the verdict is what /status shows.
    d = trial_at_gate(with_quality(on_trial_regression="alert"))
    assert d.m.ctx.verdict is None, "no verdict before the gate"
    gate(d, **readings)  # type: ignore[arg-type]
    assert d.m.ctx.verdict is verdict
    if verdict is core.TrialVerdict.INCONCLUSIVE:
        assert d.m.ctx.upgrade is core.UpgradeState.TRIAL and not d.m.ctx.regressed
