"""The pure classifier, case by case: facts in, kinds out. No processes, no NVML."""

from __future__ import annotations

import json

import pytest

from supervisor.gpu import Kind, ProcFacts, classify
from supervisor.gpu.nvml import (
    GiB,
    GpuProcess,
    GpuSnapshot,
    UnknownDevice,
    gpu_status,
    select,
)
from supervisor.process.identity import ProcessIdentity

ME = 1000
OTHER = 1001
MATCH = ("sglang", "launch_server")
OWNER = "/var/lib/kimi-serve"


def gpu(index: int, *procs: tuple[int, int | None], used: int | None = None) -> GpuSnapshot:
    held = sum(b or 0 for _, b in procs)
    return GpuSnapshot(
        index=index,
        uuid=f"GPU-{index:08x}-aaaa-bbbb-cccc-dddddddddddd",
        name="NVIDIA H200",
        memory_used_bytes=held if used is None else used,
        memory_total_bytes=141 * GiB,
        processes=tuple(GpuProcess(pid, b) for pid, b in procs),
    )


def facts(
    pid: int,
    *cmd: str,
    uid: int = ME,
    status: str = "sleeping",
    start: float = 100.0,
    ppid: int = 1,
    owner: str | None = None,
    sid: int | None = None,
) -> ProcFacts:
    return ProcFacts(pid, start, cmd, uid, f"user{uid}", status, ppid, owner, sid, sid)


def run(
    snaps: list[GpuSnapshot],
    known: list[ProcFacts],
    current: set[ProcessIdentity] | None = None,
    recorded: set[ProcessIdentity] | None = None,
    **kw: object,
) -> dict[int | None, tuple[Kind, bool]]:
    out = classify(
        snaps,
        {f.pid: f for f in known},
        current or set(),
        recorded or set(),
        MATCH,
        ME,
        **kw,  # type: ignore[arg-type]
    )
    return {c.pid: (c.kind, c.ours) for c in out}


SCHED = ("python", "-m", "sglang.launch_server", "--tp-size", "8")


def test_current_child_is_left_alone() -> None:
    got = run([gpu(0, (10, GiB))], [facts(10, *SCHED)], current={ProcessIdentity(10, 100.0)})
    assert got == {10: (Kind.CURRENT, True)}


def test_matching_process_of_the_daemons_user_is_a_leftover() -> None:
    got = run(
        [gpu(0, (10, GiB)), gpu(1, (11, GiB))],
        [
            facts(10, *SCHED),
            facts(11, "sglang::scheduler_TP1"),
        ],
    )
    assert got == {10: (Kind.LEFTOVER, True), 11: (Kind.LEFTOVER, True)}


def test_recorded_process_is_a_leftover_even_when_its_command_line_does_not_match() -> None:
    got = run(
        [gpu(0, (10, GiB))],
        [facts(10, "python", "worker.py")],
        recorded={ProcessIdentity(10, 100.0)},
    )
    assert got == {10: (Kind.LEFTOVER, True)}


def test_recorded_process_holding_no_gpu_memory_is_swept_too() -> None:
    out = classify(
        [gpu(0)],
        {20: facts(20, "sglang::detokenizer")},
        set(),
        {ProcessIdentity(20, 100.0)},
        MATCH,
        ME,
    )
    assert [(c.pid, c.kind, c.gpus, c.used_bytes) for c in out] == [(20, Kind.LEFTOVER, (), 0)]
    assert out[0].to_remove


def test_reused_pid_is_not_the_recorded_process() -> None:
    # Same pid, another start time: the recorded process is gone and the pid names another.
    wrong = {ProcessIdentity(10, 50.0)}
    assert run([gpu(0, (10, GiB))], [facts(10, "python", "train.py")], recorded=wrong) == {
        10: (Kind.FOREIGN, False)
    }
    # ... and when that other process holds no GPU memory, it is not reported at all.
    assert run([gpu(0)], [facts(10, "python", "train.py")], recorded=wrong) == {}
    # A current identity with the wrong start time does not protect a leftover either.
    got = run([gpu(0, (10, GiB))], [facts(10, *SCHED)], current={ProcessIdentity(10, 50.0)})
    assert got == {10: (Kind.LEFTOVER, True)}


def test_create_time_within_slack_is_the_same_process() -> None:
    got = run(
        [gpu(0, (10, GiB))], [facts(10, "x", start=100.0)], recorded={ProcessIdentity(10, 100.01)}
    )
    assert got == {10: (Kind.LEFTOVER, True)}


def test_matching_process_of_another_user_is_foreign() -> None:
    got = run([gpu(0, (10, GiB))], [facts(10, *SCHED, uid=OTHER)])
    assert got == {10: (Kind.FOREIGN, False)}
    out = classify([gpu(0, (10, GiB))], {10: facts(10, *SCHED, uid=OTHER)}, set(), set(), MATCH, ME)
    assert "user1001" in out[0].reason


def test_non_matching_process_is_foreign() -> None:
    assert run([gpu(0, (10, GiB))], [facts(10, "python", "train.py")]) == {
        10: (Kind.FOREIGN, False)
    }


def test_match_is_a_substring_of_the_joined_command_line() -> None:
    # "launch" + "_server" split over two arguments does not match; inside one argument it does.
    assert run([gpu(0, (10, GiB))], [facts(10, "launch", "_server")])[10][0] is Kind.FOREIGN
    assert run([gpu(0, (10, GiB))], [facts(10, "/opt/x/launch_server.py")])[10][0] is Kind.LEFTOVER


def test_owner_marker_decides_before_the_command_line() -> None:
    snaps = [gpu(0, (10, GiB), (11, GiB), (12, GiB))]
    known = [
        facts(10, "python", "worker.py", owner=OWNER),  # ours, though it does not match
        facts(11, *SCHED, owner="/var/lib/kimi-serve-b"),  # another daemon's SGLang
        facts(12, *SCHED),  # no marker: the match rule
    ]
    assert run(snaps, known, owner=OWNER) == {
        10: (Kind.LEFTOVER, True),
        11: (Kind.FOREIGN, False),
        12: (Kind.LEFTOVER, True),
    }
    # Without knowing our own marker, markers are ignored.
    assert run(snaps, known)[10] == (Kind.FOREIGN, False)


# A scheduler's environment as psutil reads it without SPT_NOENV=1: setproctitle reused the
# memory, the marker is gone, the command line is the title alone.
TITLE_ONLY = ("sglang::scheduler_TP3", "", "")


def test_session_of_the_recorded_launch_is_ours_without_the_marker() -> None:
    main = ProcessIdentity(500, 100.0)  # the launch's main process, leader of its session
    snaps = [gpu(0, (20, GiB), (21, GiB), (22, GiB))]
    # A command line no gpus.match entry hits, so only the session can make it ours.
    known = [
        facts(20, "python3", start=101.0, sid=500),  # not recorded, no marker
        facts(21, "python3", start=101.0, sid=77),  # another session
        facts(22, "python3", start=99.0, sid=500),  # older than the launch
        facts(23, *TITLE_ONLY, uid=OTHER, start=101.0, sid=500),  # another user's
    ]
    snaps = [gpu(0, (20, GiB), (21, GiB), (22, GiB), (23, GiB))]
    recorded = {main, ProcessIdentity(501, 100.5)}
    got = run(snaps, known, recorded=recorded, owner=OWNER)
    assert got[20] == (Kind.LEFTOVER, True)
    assert got[21] == (Kind.FOREIGN, False)
    assert got[22] == (Kind.FOREIGN, False)
    # The session id of a dead leader may be someone else's now: only the daemon's uid counts.
    assert got[23] == (Kind.FOREIGN, False)
    reason = next(
        c.reason
        for c in classify(snaps, {f.pid: f for f in known}, set(), recorded, MATCH, ME)
        if c.pid == 20
    )
    assert "session" in reason and "500" in reason
    # The leader's pid now names another process: the session id says nothing any more.
    reused = [*known, facts(500, "bash", start=300.0, sid=500)]
    assert run(snaps, reused, recorded=recorded, owner=OWNER)[20] == (Kind.FOREIGN, False)
    # The leader alive as recorded: still ours.
    alive = [*known, facts(500, "python", "-m", "sglang.launch_server", start=100.0, sid=500)]
    assert run(snaps, alive, recorded=recorded, owner=OWNER)[20] == (Kind.LEFTOVER, True)
    # Without a record, nothing names the session.
    assert run(snaps, known, owner=OWNER)[20] == (Kind.FOREIGN, False)


@pytest.mark.parametrize(
    ("proc", "recorded", "want"),
    [
        (facts(10, status="zombie", ppid=42), True, (Kind.ZOMBIE, True)),
        (facts(10, status="zombie", ppid=42), False, (Kind.ZOMBIE, False)),
        (facts(10, *SCHED, status="disk-sleep"), False, (Kind.STUCK, True)),
        (facts(10, "python", "train.py", status="disk-sleep"), False, (Kind.STUCK, False)),
        (facts(10, *SCHED, status="disk-sleep", uid=OTHER), False, (Kind.STUCK, False)),
    ],
)
def test_zombie_and_d_state(proc: ProcFacts, recorded: bool, want: tuple[Kind, bool]) -> None:
    rec = {ProcessIdentity(10, 100.0)} if recorded else set()
    assert run([gpu(0, (10, GiB))], [proc], recorded=rec) == {10: want}


def test_only_leftovers_and_our_stuck_processes_are_to_be_removed() -> None:
    snaps = [gpu(0, (1, GiB), (2, GiB), (3, GiB), (4, GiB), (5, GiB))]
    known = [
        facts(1, *SCHED),
        facts(2, *SCHED, status="disk-sleep"),
        facts(3, "train.py", status="disk-sleep"),
        facts(4, "train.py"),
        facts(5, *SCHED, status="zombie"),
    ]
    out = classify(snaps, {f.pid: f for f in known}, {ProcessIdentity(6, 1.0)}, set(), MATCH, ME)
    assert sorted(c.pid for c in out if c.to_remove and c.pid) == [1, 2]


def test_current_wins_over_zombie_and_d_state() -> None:
    # The current child's exit is the process owner's to reap, not cleaning's.
    ident = {ProcessIdentity(10, 100.0)}
    assert (
        run([gpu(0, (10, GiB))], [facts(10, status="zombie")], current=ident)[10][0] is Kind.CURRENT
    )
    assert (
        run([gpu(0, (10, GiB))], [facts(10, status="disk-sleep")], current=ident)[10][0]
        is Kind.CURRENT
    )


def test_pid_listed_by_nvml_but_invisible_is_wedged() -> None:
    out = classify([gpu(0, (10, 3 * GiB))], {}, set(), set(), MATCH, ME)
    assert [(c.kind, c.pid, c.gpus, c.used_bytes) for c in out] == [
        (Kind.WEDGED, 10, (0,), 3 * GiB)
    ]
    assert not out[0].ours and not out[0].to_remove


def test_memory_with_no_process_is_wedged_above_the_threshold_only() -> None:
    snaps = [gpu(0, used=2 * GiB), gpu(1, used=100 << 20)]
    out = classify(snaps, {}, set(), set(), MATCH, ME, threshold_bytes=1 << 30)
    assert [(c.kind, c.pid, c.gpus) for c in out] == [(Kind.WEDGED, None, (0,))]


def test_recorded_and_gone_is_nothing() -> None:
    assert run([gpu(0)], [], recorded={ProcessIdentity(10, 100.0)}) == {}


def test_process_on_several_gpus_is_one_entry_with_summed_memory() -> None:
    out = classify(
        [gpu(0, (10, GiB)), gpu(1, (10, 2 * GiB)), gpu(2, (10, None))],
        {10: facts(10, *SCHED)},
        set(),
        set(),
        MATCH,
        ME,
    )
    assert [(c.pid, c.gpus, c.used_bytes) for c in out] == [(10, (0, 1, 2), None)]
    out = classify(
        [gpu(0, (10, GiB)), gpu(1, (10, 2 * GiB))], {10: facts(10, *SCHED)}, set(), set(), MATCH, ME
    )
    assert out[0].used_bytes == 3 * GiB


def test_classified_serialises_to_json() -> None:
    out = classify([gpu(0, (10, GiB))], {10: facts(10, *SCHED)}, set(), set(), MATCH, ME)
    d = json.loads(json.dumps(out[0].to_dict()))
    assert d["kind"] == "leftover" and d["pid"] == 10 and d["create_time"] == 100.0


# ------------------------------------------------------------------------- select, status


def test_select_by_index_and_uuid() -> None:
    snaps = [gpu(1), gpu(0), gpu(2)]
    assert [s.index for s in select(snaps, "all")] == [0, 1, 2]
    assert [s.index for s in select(snaps, (2, 0))] == [2, 0]
    assert [s.index for s in select(snaps, (snaps[0].uuid.upper(), 1))] == [1]


def test_select_unknown_device_names_it_and_what_exists() -> None:
    with pytest.raises(UnknownDevice) as err:
        select([gpu(0), gpu(1)], (0, 7, "GPU-nope"))
    msg = str(err.value)
    assert "7, GPU-nope" in msg and "0 (GPU-00000000" in msg and "gpus.devices" in msg


def test_gpu_status_lists_memory_and_pids() -> None:
    assert gpu_status([gpu(3, (10, GiB), (11, None))]) == [
        {
            "index": 3,
            "uuid": "GPU-00000003-aaaa-bbbb-cccc-dddddddddddd",
            "name": "NVIDIA H200",
            "memory_used_bytes": GiB,
            "memory_total_bytes": 141 * GiB,
            "processes": [10, 11],
        }
    ]
