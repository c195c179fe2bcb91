"""`restart --wait`'s decisions (supervisor/admin/wait.py): which /status ends the wait and how,
and what the progress shows."""

from __future__ import annotations

import io
from typing import Any

import pytest

from supervisor.admin import reexec_command, wait
from supervisor.admin.wait import Goal
from supervisor.sglang.loadphases import LoadTimeline


def doc(state: str, launch: int, **extra: Any) -> dict[str, Any]:
    child = {"pid": 10, "launch": launch} if state in ("ready", "degraded", "loading") else None
    return {"state": state, "launch": launch, "child": child, "profile": "primary", **extra}


@pytest.mark.parametrize(
    ("status", "code", "says"),
    [
        (doc("ready", 5), 0, "ready (launch 5, profile primary)"),
        (doc("degraded", 6), 0, "degraded (launch 6, profile primary)"),
        (doc("ready", 5, profile="fallback"), 6, "ready on the fallback profile"),
        (
            doc("ready", 5, upgrade={"state": "rolled_back"}),
            7,
            "ready on the rolled-back last known good",
        ),
    ],
)
def test_serving_on_the_awaited_launch_ends_the_wait(
    status: dict[str, Any], code: int, says: str
) -> None:
    outcome = wait.verdict(status, Goal(launch=5), fresh=True)
    assert outcome is not None and outcome.code == code and says in outcome.message


def test_the_old_launch_still_ready_is_not_the_outcome() -> None:
    # Between the accept and the daemon taking the request, launch 4 still serves.
    assert wait.verdict(doc("ready", 4), Goal(launch=5), fresh=False) is None
    assert wait.verdict(doc("loading", 5), Goal(launch=5), fresh=True) is None


def handed(
    state: str, launch: int, at: float | None, outcome: str = "ok", **extra: Any
) -> dict[str, Any]:
    last = None if at is None else {"at": at, "outcome": outcome, "from_version": "0.1.0"}
    if last is not None:
        last.update(extra.pop("last", {}))
    daemon = {"version": "0.2.0", "pid": 77, "handoffs": 1, "last_handoff": last}
    return doc(state, launch, daemon=daemon, **extra)


def test_a_hand_over_waits_for_a_last_handoff_other_than_the_one_it_found() -> None:
    goal = Goal(handover=True, last_at=500.0)
    # The old program, or the new one still probing SGLang: keep waiting.
    assert wait.verdict(handed("ready", 3, 500.0), goal, fresh=True) is None
    assert wait.verdict(handed("ready", 3, None), Goal(handover=True), fresh=True) is None
    done = handed("ready", 3, 900.0, last={"seconds": 1.25})
    outcome = wait.verdict(done, goal, fresh=False)
    assert outcome == wait.Outcome(
        0,
        "ready: handed over from kimi-serve 0.1.0 to 0.2.0 in 1.2 s (pid 77); SGLang kept "
        "running (launch 3, profile primary)",
    )
    # The first hand-over of a daemon: the request found none.
    assert wait.verdict(done, Goal(handover=True), fresh=False) == outcome


def test_a_hand_over_that_fell_back_is_8_with_why_once_the_relaunch_serves() -> None:
    goal = Goal(handover=True, last_at=None)
    why = {"why": "the configuration changes SGLang's command line (/etc/k.yaml): relaunching"}
    assert wait.verdict(handed("loading", 4, 900.0, "fallback", last=why), goal, False) is None
    outcome = wait.verdict(handed("ready", 4, 900.0, "fallback", last=why), goal, False)
    assert outcome == wait.Outcome(
        8,
        "ready, but the hand-over fell back to a restart: the configuration changes SGLang's "
        "command line (/etc/k.yaml): relaunching (launch 4, profile primary)",
    )
    # ... and a relaunch that ends in `failed` is 1, with its reason.
    failed = handed("failed", 4, 900.0, "fallback", last=why, detail="crash loop")
    assert wait.verdict(failed, goal, fresh=False) == wait.Outcome(1, "failed: crash loop")
    # Without the hand-over goal the fallback is not looked at (restart --wait).
    assert wait.verdict(handed("ready", 4, 900.0, "fallback"), Goal(), fresh=True) == (
        wait.Outcome(0, "ready (launch 4, profile primary)")
    )


def test_a_hand_over_that_did_not_exec_is_1_with_why() -> None:
    st = handed("ready", 3, 900.0, "failed", last={"why": "a StopRequested came first"})
    outcome = wait.verdict(st, Goal(handover=True, last_at=500.0), fresh=False)
    assert outcome == wait.Outcome(1, "the hand-over failed, no exec: a StopRequested came first")


def test_an_older_daemon_s_hand_over_is_judged_by_the_clock() -> None:
    # Its answer named no last_handoff: one from before the request is not this one.
    goal = reexec_command.goal({"accepted": True}, sent_at=1000.0)
    assert wait.verdict(handed("ready", 3, 990.0), goal, fresh=True) is None
    outcome = wait.verdict(handed("ready", 3, 1001.0), goal, fresh=True)
    assert outcome is not None and outcome.code == 0


def test_the_goal_comes_from_the_answer() -> None:
    answer = {"accepted": True, "daemon": {"handoffs": 2, "last_handoff": {"at": 123.5}}}
    assert reexec_command.goal(answer, 999.0) == Goal(handover=True, last_at=123.5)
    first = {"accepted": True, "daemon": {"handoffs": 0, "last_handoff": None}}
    assert reexec_command.goal(first, 999.0) == Goal(handover=True, last_at=None)


def test_a_slow_answer_at_the_end_of_the_wait_is_3_not_4() -> None:
    now = [0.0]
    answers = iter([handed("ready", 3, 500.0)])

    def get() -> dict[str, Any]:
        for st in answers:
            return st
        now[0] = 31.0  # the read took the rest of the wait
        raise wait.adminclient.Unreachable("timed out")

    outcome = wait.follow(
        get,
        Goal(handover=True, last_at=500.0),
        30.0,
        io.StringIO(),
        clock=lambda: now[0],
        sleep=lambda s: None,
    )
    assert outcome.code == 3 and "not ready after 30 s: timed out" in outcome.message
    # Refused or reset with time left: the daemon is gone.
    now[0] = 0.0
    answers = iter([handed("ready", 3, 500.0)])

    def gone() -> dict[str, Any]:
        for st in answers:
            return st
        raise wait.adminclient.Unreachable("connection refused")

    outcome = wait.follow(
        gone,
        Goal(handover=True, last_at=500.0),
        30.0,
        io.StringIO(),
        clock=lambda: now[0],
        sleep=lambda s: None,
    )
    assert outcome.code == 4


def test_a_hand_over_s_progress_shows_the_daemon() -> None:
    line = wait.progress_line(handed("ready", 3, None), 2.0, daemon=True)
    assert (
        line == "ready (launch 3, primary), kimi-serve 0.2.0, 1 hand-over, restarts 0, waited 2 s"
    )


def test_undrain_waits_for_the_registration() -> None:
    router = {"url": "http://r:30000", "registered": False}
    goal = Goal(registered=True)
    assert wait.verdict(doc("ready", 3, router=router), goal, fresh=True) is None
    router["registered"] = True
    outcome = wait.verdict(doc("ready", 3, router=router), goal, fresh=True)
    assert outcome is not None and outcome.code == 0
    # Without router.url there is nothing to wait for.
    unlinked = doc("ready", 3, router={"url": None})
    assert wait.verdict(unlinked, goal, fresh=True) is not None


def test_failed_names_the_reason_and_the_incident_once_fresh() -> None:
    st = doc(
        "failed",
        7,
        detail="crash loop: 2 restarts in 1h",
        last_restart={"reason": "exited", "incident": "/var/lib/i/20261203T170000Z-exited-launch7"},
    )
    # The request found the daemon failed: that is not yet its outcome.
    assert wait.verdict(st, Goal(launch=8), fresh=False) is None
    outcome = wait.verdict(st, Goal(launch=8), fresh=True)
    assert outcome == wait.Outcome(
        1,
        "failed: crash loop: 2 restarts in 1h; incident 20261203T170000Z-exited-launch7 "
        "(kimi-serve incidents show 20261203T170000Z-exited-launch7)",
    )


def test_a_failure_entered_after_the_request_is_its_outcome_from_the_first_poll() -> None:
    st = doc("failed", 7, since=1000.0, detail="GPU 0 needs a reset")
    now = [0.0]
    get = iter([st]).__next__
    outcome = wait.follow(
        get, Goal(launch=8, sent_at=999.5), 60.0, io.StringIO(), clock=lambda: now[0]
    )
    assert outcome == wait.Outcome(1, "failed: GPU 0 needs a reset")
    # One that predates the request is not (the wait would go on: here, past the script).
    get = iter([{**st, "since": 900.0}]).__next__
    with pytest.raises(StopIteration):
        wait.follow(
            get,
            Goal(launch=8, sent_at=999.5),
            60.0,
            io.StringIO(),
            clock=lambda: now[0],
            sleep=lambda s: None,
        )


def test_the_progress_line_shows_phase_budget_and_restarts() -> None:
    loading = {"launch": 5, "phase": "weights", "elapsed_s": 90.0, "load_timeout_s": 600.0}
    st = doc("loading", 5, loading=loading, restarts={"manual": 2, "exited": 1})
    assert wait.progress_line(st, 91.4) == (
        "loading (launch 5, primary), phase weights, 90 s of load_timeout 600 s (15%), "
        "restarts 3, waited 91 s"
    )


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _script(docs: list[dict[str, Any]]) -> tuple[wait.Get, list[float]]:
    now = [0.0]
    it = iter(docs)

    def get() -> dict[str, Any]:
        return next(it)

    return get, now


@pytest.mark.parametrize("tty", [False, True])
def test_follow_shows_one_line_per_change_or_one_line_in_place(tty: bool) -> None:
    load = {"launch": 2, "phase": "init", "elapsed_s": 1.0, "load_timeout_s": 60.0}
    docs = [
        doc("ready", 1),
        doc("loading", 2, loading=load, restarts={"manual": 1}),
        doc("loading", 2, loading={**load, "elapsed_s": 2.0}, restarts={"manual": 1}),
        doc("loading", 2, loading={**load, "phase": "weights"}, restarts={"manual": 1}),
        doc("ready", 2, restarts={"manual": 1}),
    ]
    get, now = _script(docs)

    def sleep(s: float) -> None:
        now[0] += s

    stream: io.StringIO = Tty() if tty else io.StringIO()
    outcome = wait.follow(get, Goal(launch=2), None, stream, clock=lambda: now[0], sleep=sleep)
    assert outcome.code == 0
    text = stream.getvalue()
    if tty:
        assert text.count("\r") == 5 and text.count("\x1b[K") == 5 and text.endswith("\n")
        assert text.count("\n") == 1
    else:
        lines = text.splitlines()
        # The second "loading, init" is the same phase: not shown again.
        assert [ln.split(",")[0] for ln in lines] == ["ready (launch 1"] + [
            "loading (launch 2"
        ] * 2 + ["ready (launch 2"]
        assert "phase weights" in lines[2]


def test_follow_gives_up_at_the_timeout_with_3() -> None:
    load = {"launch": 2, "phase": "weights", "elapsed_s": 1.0, "load_timeout_s": 60.0}
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    outcome = wait.follow(
        lambda: doc("loading", 2, loading=load),
        Goal(launch=2),
        3.0,
        io.StringIO(),
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert outcome.code == 3 and outcome.message.startswith("not ready after 3 s: loading")
    # Without --timeout: twice the load_timeout /status names.
    assert wait.default_timeout(doc("loading", 2, loading=load)) == 120.0
    assert wait.default_timeout(doc("ready", 1)) == 2 * wait.FALLBACK_LOAD_TIMEOUT_S


@pytest.mark.parametrize(
    ("lines", "phase"),
    [
        ([], "init"),
        (["Load weight begin"], "weights"),
        (["Load weight begin", "Load weight end"], "kv_cache"),
        (["Load weight begin", "Load weight end", "Capture cuda graph begin"], "cuda_graph"),
        (["Load weight begin", "Uvicorn running on http://x"], "warmup"),
        (["Uvicorn running on http://x", "The server is fired up and ready to roll!"], "probe"),
    ],
)
def test_the_load_timeline_names_the_phase_it_is_in(lines: list[str], phase: str) -> None:
    t = LoadTimeline(0.0)
    for n, line in enumerate(lines, 1):
        t.feed(line, float(n))
    assert t.current() == phase
    t.probe_ok(99.0)
    assert t.current() == "done"


def test_drain_and_undrain_answers_read_like_status() -> None:
    from supervisor.admin.control_commands import render_answer

    router = {
        "url": "http://r:30000",
        "worker_url": "http://10.0.0.5:30000",
        "registered": False,
        "wanted": False,
        "worker_id": None,
        "last_error": None,
    }
    busy = {"idle": False, "waited_s": 30.0, "running": 2, "queued": 1, "error": "not idle"}
    text = render_answer("drain", 200, {"drained": True, "router": router, "drain": busy})
    assert text.splitlines() == [
        "● drain done",
        "    Router: http://r:30000 as http://10.0.0.5:30000, not registered (not ready)",
        " In flight: NOT IDLE after 30.0 s (2 running, 1 queued)",
        "            not idle",
        "      Next: `kimi-serve undrain` (or a restart) puts it back",
    ]
    wanted = {**router, "wanted": True}
    text = render_answer("undrain", 200, {"undrained": True, "router": wanted})
    assert text.splitlines()[1].endswith(
        "NOT REGISTERED (wanted: registering, retried with backoff)"
    )
    assert render_answer("restart", 202, {"accepted": True, "launch": 9}).startswith(
        "restart accepted: launch 9 on the primary profile"
    )
