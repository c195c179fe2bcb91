"""The pure fitness verdicts: each condition, "not supported" never deciding, the one line."""

from __future__ import annotations

import pytest

from supervisor.gpu.fitness import (
    NOT_SUPPORTED,
    Action,
    HealthRead,
    XidEvent,
    assess,
    assess_all,
    select_reads,
)

UUID = "GPU-6be7c66e-c474-7fdb-69e1-06bcec8f0a69"


def healthy(index: int = 0, uuid: str = UUID, **over: object) -> HealthRead:
    base: dict[str, object] = {
        "recovery_action": 0,
        "remapped_pending": False,
        "remapped_failure": False,
        "remapped_uncorrectable": 0,
        "remapped_correctable": 0,
        "ecc_uncorrected_volatile": 0,
    }
    base.update(over)
    return HealthRead(index, uuid, lost=False, **base)  # type: ignore[arg-type]


def test_a_healthy_gpu_as_the_h200_reported_it_is_fit() -> None:
    f = assess(healthy())
    assert f.ok and f.action is Action.NONE and f.reasons == () and f.not_supported == ()
    assert f.line() == f"GPU 0 ({UUID}) is fit"


@pytest.mark.parametrize(
    ("read", "action", "reason"),
    [
        (HealthRead(0, UUID, lost=True), Action.REBOOT, "the GPU is lost"),
        (healthy(recovery_action=1), Action.RESET, "recovery action gpu_reset"),
        (healthy(recovery_action=2), Action.REBOOT, "recovery action node_reboot"),
        (healthy(recovery_action=3), Action.RESET, "recovery action drain_p2p"),
        (healthy(recovery_action=4), Action.RESET, "recovery action drain_and_reset"),
        (healthy(recovery_action=7), Action.REBOOT, "recovery action system_reboot"),
        (healthy(recovery_action=99), Action.RESET, "recovery action unknown (99)"),
        (healthy(remapped_pending=True), Action.RESET, "row remapping pending"),
        (healthy(remapped_failure=True), Action.REPLACE, "row remapping failed"),
        (healthy(ecc_uncorrected_volatile=2), Action.RESET, "2 uncorrectable ECC error(s)"),
    ],
)
def test_each_condition_makes_the_gpu_unfit(read: HealthRead, action: Action, reason: str) -> None:
    f = assess(read)
    assert not f.ok
    assert f.action is action
    assert any(reason in r for r in f.reasons), f.reasons
    line = f.line()
    assert line.startswith(f"GPU 0 ({UUID}) needs a {action.value}: ")
    assert "\n" not in line


def test_the_most_drastic_action_wins() -> None:
    f = assess(healthy(remapped_pending=True, remapped_failure=True, recovery_action=1))
    assert f.action is Action.REPLACE
    assert len(f.reasons) == 3


def test_not_supported_fields_decide_nothing_and_are_named() -> None:
    f = assess(HealthRead(0, UUID, lost=False))  # every field NOT_SUPPORTED
    assert f.ok and f.action is Action.NONE
    assert set(f.not_supported) == {
        "recovery_action",
        "remapped_pending",
        "remapped_failure",
        "remapped_uncorrectable",
        "remapped_correctable",
        "ecc_uncorrected_volatile",
    }
    h = f.health()
    # Distinct from a zero or a False in /status.
    assert h["recovery_action"] == "not_supported"
    assert h["ecc_uncorrected_volatile"] == "not_supported"
    assert h["remapped_rows"]["pending"] == "not_supported"


def test_not_supported_does_not_hide_a_supported_fault() -> None:
    f = assess(HealthRead(0, UUID, lost=False, remapped_pending=True))
    assert not f.ok and f.action is Action.RESET
    assert "recovery_action" in f.not_supported


def test_not_supported_is_not_a_number() -> None:
    assert NOT_SUPPORTED != 0 and NOT_SUPPORTED is not False
    assert not isinstance(NOT_SUPPORTED, int)


def test_an_xid_alone_is_reported_not_judged() -> None:
    xid = XidEvent(0, UUID, "xid", 31, 1.0)  # a page fault: the application's bug
    f = assess(healthy(), xid)
    assert f.ok
    assert f.health()["last_xid"]["xid"] == 31
    bad = assess(healthy(recovery_action=1), XidEvent(0, UUID, "xid", 48, 1.0))
    assert "last event Xid 48 (double-bit ECC error)" in bad.reasons


def test_status_health_has_the_contract_keys() -> None:
    h = assess(healthy()).health()
    for key in ("ok", "recovery_action", "remapped_rows", "ecc_uncorrected_volatile", "last_xid"):
        assert key in h
    assert h["recovery_action"] == "none"


def test_report_line_names_every_unfit_gpu_worst_first() -> None:
    r = assess_all(
        [
            healthy(0, "GPU-a"),
            healthy(1, "GPU-b", remapped_pending=True),
            healthy(2, "GPU-c", remapped_failure=True),
        ]
    )
    assert not r.ok
    assert r.action is Action.REPLACE
    assert r.line() == (
        "GPU 2 (GPU-c) needs a replace: row remapping failed (no spare rows left) | "
        "GPU 1 (GPU-b) needs a reset: row remapping pending (applied at the next GPU reset)"
    )
    assert [f.index for f in r.unfit] == [1, 2]


def test_restart_only_where_lost_or_the_driver_asks() -> None:
    assert not assess_all([healthy(remapped_pending=True)]).restart_needed
    assert not assess_all([healthy(ecc_uncorrected_volatile=1)]).restart_needed
    assert not assess_all([HealthRead(0, UUID, lost=False)]).restart_needed
    assert assess_all([healthy(recovery_action=4)]).restart_needed
    assert assess_all([HealthRead(0, UUID, lost=True)]).restart_needed


def test_last_xids_are_matched_by_uuid() -> None:
    xid = XidEvent(1, "GPU-b", "xid", 79, 2.0)
    r = assess_all([healthy(0, "GPU-a"), healthy(1, "GPU-b")], {"GPU-b": xid})
    assert r.gpus[0].last_xid is None and r.gpus[1].last_xid == xid


def test_select_reads_by_index_or_uuid() -> None:
    reads = [healthy(i, f"GPU-{i}") for i in range(4)]
    assert [r.index for r in select_reads(reads, "all")] == [0, 1, 2, 3]
    assert [r.index for r in select_reads(reads, (2, "gpu-0"))] == [0, 2]
    assert select_reads(reads, (7,)) == []
