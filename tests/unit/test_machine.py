"""The supervision state machine, driven by hand with an explicit clock.

Every test passes `now` itself: nothing sleeps, nothing runs in the background. The table at the
top takes every edge of `EDGES` and pins the actions that go with it; the tests after it cover
one rule each (backoff, crash loop, liveness, requests, stale events). The property tests at the
end play the daemon's side, a FIFO event queue plus effects in flight, and check the invariants
after every event: no illegal edge, never ready without a decode probe of the current launch,
never two launches at once, never stuck.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from supervisor.config import PRIMARY, Config
from supervisor.core.machine import (
    EDGES,
    EX_RESTART_BY_ORCHESTRATOR,
    PROBE_RETRY_DELAY,
    Action,
    CancelTimer,
    CheckIntent,
    ChildExited,
    ChildGone,
    CleanHost,
    ConfigRead,
    DrainRequested,
    Event,
    Exit,
    FatalLog,
    HostNotReady,
    HostReady,
    Launch,
    Launched,
    LaunchFailed,
    Machine,
    NotifyReady,
    NotifyReloaded,
    NotifyReloading,
    PortOpen,
    ProbeDone,
    ProbeKind,
    ProfileChanged,
    ReadConfig,
    ReadyLine,
    Reason,
    RecordRestart,
    ReloadRequested,
    RestartRequested,
    SetTimer,
    Start,
    StartProbe,
    State,
    StopChild,
    StopRequested,
    TimerFired,
    TimerName,
    Transitioned,
    UndrainRequested,
    Verdict,
    WatchesEnd,
    watches_end,
)
from supervisor.sglang.probe import ProbeResult
from testkit.machine import (
    ALL_TIMERS,
    CFG,
    FALLBACK,
    LAUNCH_TIMERS,
    PID,
    SCHEDULER_EXCEPTION,
    T0,
    ZERO_TOKENS,
    Drive,
    backoff_delays,
    check_edge,
    edge_ids,
    events,
    failed_result,
    make_cfg,
    not_up_result,
    of,
    ok_result,
    transitions,
)
from testkit.machine_runs import CONFIGS, RESULTS, SETTINGS, Invariants, daemon_like_run

# ------------------------------------------------------------------------------ probe results


# ------------------------------------------------------------------------------ the driver


# ------------------------------------------------------------------------------ every edge


def _stop_no_child(path: Callable[[Drive], Drive], old: State) -> Callable[[], Any]:
    def case() -> tuple[list[Action], list[Action]]:
        d = path(Drive())
        return d.send(StopRequested()), [
            Transitioned(old, State.STOPPING, "SIGTERM"),
            *ALL_TIMERS,
            Transitioned(State.STOPPING, State.STOPPED, "no_child"),
            Exit(0),
        ]

    return case


def _stop_with_child(path: Callable[[Drive], Drive], old: State) -> Callable[[], Any]:
    def case() -> tuple[list[Action], list[Action]]:
        d = path(Drive())
        return d.send(StopRequested("SIGINT")), [
            Transitioned(old, State.STOPPING, "SIGINT"),
            *ALL_TIMERS,
            StopChild(d.launch, graceful=True),
        ]

    return case


def _starting_cleaning() -> Any:
    return Drive().send(Start()), [
        Transitioned(State.STARTING, State.CLEANING, "started"),
        CleanHost(),
    ]


def _cleaning_launching() -> Any:
    d = Drive().cleaning()
    return d.send(HostReady()), [
        Transitioned(State.CLEANING, State.LAUNCHING, "host_ready", "profile primary"),
        Launch(1, PRIMARY),
    ]


def _cleaning_failed() -> Any:
    d = Drive().cleaning()
    msg = "process 77 survives SIGKILL (D state)"
    return d.send(HostNotReady(msg, wedged=True)), [
        Transitioned(State.CLEANING, State.FAILED, "gpu_wedged", msg)
    ]


MISSING = "sglang.model_path /shared/kimi-k2.5-int4 does not exist"


def _cleaning_waiting() -> Any:
    d = Drive().cleaning()
    return d.send(HostNotReady(MISSING, model_missing=True)), [
        Transitioned(State.CLEANING, State.WAITING, "model_missing", MISSING),
        SetTimer(TimerName.CLEAN_RETRY, 5.0, 0),
    ]


def _waiting_launching() -> Any:
    d = Drive().waiting()
    d.send(TimerFired(TimerName.CLEAN_RETRY, 0), after=5)
    return d.send(HostReady()), [
        Transitioned(State.WAITING, State.LAUNCHING, "host_ready", "profile primary"),
        Launch(1, PRIMARY),
    ]


def _waiting_cleaning() -> Any:
    d = Drive().waiting()
    busy = "127.0.0.1:30000 is in use (sglang.port)"
    return d.send(HostNotReady(busy)), [
        Transitioned(State.WAITING, State.CLEANING, "host_not_ready", busy),
        SetTimer(TimerName.CLEAN_RETRY, 10.0, 0),
    ]


def _waiting_failed() -> Any:
    d = Drive().waiting()
    msg = "process 77 survives SIGKILL (D state)"
    return d.send(HostNotReady(msg, wedged=True)), [
        Transitioned(State.WAITING, State.FAILED, "gpu_wedged", msg)
    ]


def _launching_loading() -> Any:
    d = Drive().launching()
    return d.send(Launched(1, PID)), [
        Transitioned(State.LAUNCHING, State.LOADING, "launched", f"pid {PID}"),
        SetTimer(TimerName.LOAD, 1800.0, 1),
    ]


def _launching_restarting() -> Any:
    # The exec itself failed: no process exists, so no StopChild; straight to the backoff.
    d = Drive().launching()
    msg = "cannot start /opt/sglang/venv/bin/python: No such file or directory (sglang.python)"
    return d.send(LaunchFailed(1, msg)), [
        Transitioned(State.LAUNCHING, State.RESTARTING, "exited", msg),
        *LAUNCH_TIMERS,
        RecordRestart(Reason.EXITED, None, None, msg),
        SetTimer(TimerName.BACKOFF, 5.0, 1),
    ]


def _loading_warming() -> Any:
    d = Drive().loading()
    return d.send(PortOpen(1)), [
        Transitioned(State.LOADING, State.WARMING, "port_open"),
        CancelTimer(TimerName.PROBE_RETRY),
        StartProbe(1, ProbeKind.READINESS),
    ]


def _loading_restarting() -> Any:
    d = Drive().loading()
    return d.send(TimerFired(TimerName.LOAD, 1), after=1800), [
        Transitioned(State.LOADING, State.RESTARTING, "load_timeout", "no decode within 1800s"),
        *LAUNCH_TIMERS,
        StopChild(1, graceful=False),
    ]


def _warming_ready() -> Any:
    d = Drive().warming()
    result = ok_result()
    return d.send(ProbeDone(1, ProbeKind.READINESS, result)), [
        Transitioned(State.WARMING, State.READY, "probe_ok", "8 tokens"),
        CancelTimer(TimerName.LOAD),
        NotifyReady(),
        SetTimer(TimerName.LIVENESS, 15.0, 1),
        CheckIntent(1, result),
    ]


def _warming_restarting() -> Any:
    d = Drive().warming()
    return d.send(ProbeDone(1, ProbeKind.READINESS, ZERO_TOKENS)), [
        Transitioned(State.WARMING, State.RESTARTING, "readiness_failed", ZERO_TOKENS.error or ""),
        *LAUNCH_TIMERS,
        StopChild(1, graceful=False),
    ]


def _ready_degraded() -> Any:
    d = Drive().ready()
    return d.liveness(failed_result()), [
        Transitioned(State.READY, State.DEGRADED, "probe_failed", "no answer within 20s (1/3)"),
        SetTimer(TimerName.LIVENESS, 15.0, 1),
    ]


def _ready_restarting() -> Any:
    d = Drive().ready()
    return d.send(ChildExited(1, None, 9)), [
        Transitioned(State.READY, State.RESTARTING, "exited", "killed by signal 9"),
        *LAUNCH_TIMERS,
        StopChild(1, graceful=False),
    ]


def _degraded_ready() -> Any:
    d = Drive().degraded()
    return d.liveness(ok_result()), [
        Transitioned(State.DEGRADED, State.READY, "probe_ok"),
        SetTimer(TimerName.LIVENESS, 15.0, 1),
    ]


def _degraded_restarting() -> Any:
    d = Drive().degraded()
    return d.send(FatalLog(1, SCHEDULER_EXCEPTION)), [
        Transitioned(State.DEGRADED, State.RESTARTING, "fatal_log", SCHEDULER_EXCEPTION),
        *LAUNCH_TIMERS,
        StopChild(1, graceful=False),
    ]


def _restarting_cleaning() -> Any:
    d = Drive().backing_off()
    return d.send(TimerFired(TimerName.BACKOFF, 1), after=5), [
        Transitioned(State.RESTARTING, State.CLEANING, "backoff_elapsed"),
        CleanHost(),
    ]


def _restarting_failed() -> Any:
    d = Drive(make_cfg(fallback=None, max_restarts=1)).restarting()
    return d.send(ChildGone(1, None, 9)), [
        RecordRestart(Reason.EXITED, None, 9, "killed by signal 9"),
        Transitioned(
            State.RESTARTING,
            State.FAILED,
            "crash_loop",
            "1 restarts within 3600s on profile primary",
        ),
    ]


def _failed_cleaning() -> Any:
    d = Drive().failed()
    return d.send(RestartRequested(Reason.MANUAL)), [
        RecordRestart(Reason.MANUAL, None, None, "requested"),
        Transitioned(State.FAILED, State.CLEANING, "manual"),
        CleanHost(),
    ]


def _stopping_stopped() -> Any:
    d = Drive().stopping()
    return d.send(ChildGone(1, 0, None)), [
        Transitioned(State.STOPPING, State.STOPPED, "child_stopped"),
        Exit(0),
    ]


def _ready_draining() -> Any:
    d = Drive().ready()
    return d.send(DrainRequested()), [
        Transitioned(State.READY, State.DRAINING, "drain", "requested")
    ]


def _degraded_draining() -> Any:
    d = Drive().degraded()
    return d.send(DrainRequested()), [
        Transitioned(State.DEGRADED, State.DRAINING, "drain", "requested")
    ]


def _draining_ready() -> Any:
    d = Drive().draining()
    return d.send(UndrainRequested()), [Transitioned(State.DRAINING, State.READY, "undrain")]


def _draining_degraded() -> Any:
    d = Drive().draining()
    d.liveness(failed_result())
    return d.send(UndrainRequested()), [
        Transitioned(State.DRAINING, State.DEGRADED, "undrain", "liveness failing (1/3)")
    ]


def _draining_restarting() -> Any:
    d = Drive().draining()
    return d.send(RestartRequested(Reason.MANUAL)), [
        Transitioned(State.DRAINING, State.RESTARTING, "manual", "requested"),
        *LAUNCH_TIMERS,
        StopChild(1, graceful=True),
    ]


EDGE_CASES: dict[tuple[State, State], Callable[[], Any]] = {
    (State.STARTING, State.CLEANING): _starting_cleaning,
    (State.STARTING, State.STOPPING): _stop_no_child(lambda d: d, State.STARTING),
    (State.CLEANING, State.LAUNCHING): _cleaning_launching,
    (State.CLEANING, State.FAILED): _cleaning_failed,
    (State.CLEANING, State.STOPPING): _stop_no_child(Drive.cleaning, State.CLEANING),
    (State.CLEANING, State.WAITING): _cleaning_waiting,
    (State.WAITING, State.LAUNCHING): _waiting_launching,
    (State.WAITING, State.CLEANING): _waiting_cleaning,
    (State.WAITING, State.FAILED): _waiting_failed,
    (State.WAITING, State.STOPPING): _stop_no_child(Drive.waiting, State.WAITING),
    (State.LAUNCHING, State.LOADING): _launching_loading,
    (State.LAUNCHING, State.RESTARTING): _launching_restarting,
    (State.LAUNCHING, State.STOPPING): _stop_with_child(Drive.launching, State.LAUNCHING),
    (State.LOADING, State.WARMING): _loading_warming,
    (State.LOADING, State.RESTARTING): _loading_restarting,
    (State.LOADING, State.STOPPING): _stop_with_child(Drive.loading, State.LOADING),
    (State.WARMING, State.READY): _warming_ready,
    (State.WARMING, State.RESTARTING): _warming_restarting,
    (State.WARMING, State.STOPPING): _stop_with_child(Drive.warming, State.WARMING),
    (State.READY, State.DEGRADED): _ready_degraded,
    (State.READY, State.RESTARTING): _ready_restarting,
    (State.READY, State.STOPPING): _stop_with_child(Drive.ready, State.READY),
    (State.DEGRADED, State.READY): _degraded_ready,
    (State.DEGRADED, State.RESTARTING): _degraded_restarting,
    (State.DEGRADED, State.STOPPING): _stop_with_child(Drive.degraded, State.DEGRADED),
    (State.READY, State.DRAINING): _ready_draining,
    (State.DEGRADED, State.DRAINING): _degraded_draining,
    (State.DRAINING, State.READY): _draining_ready,
    (State.DRAINING, State.DEGRADED): _draining_degraded,
    (State.DRAINING, State.RESTARTING): _draining_restarting,
    (State.DRAINING, State.STOPPING): _stop_with_child(Drive.draining, State.DRAINING),
    (State.RESTARTING, State.CLEANING): _restarting_cleaning,
    (State.RESTARTING, State.FAILED): _restarting_failed,
    (State.RESTARTING, State.STOPPING): _stop_with_child(Drive.restarting, State.RESTARTING),
    (State.FAILED, State.CLEANING): _failed_cleaning,
    (State.FAILED, State.STOPPING): _stop_no_child(Drive.failed, State.FAILED),
    (State.STOPPING, State.STOPPED): _stopping_stopped,
}


def test_every_edge_in_the_table_has_a_case() -> None:
    edges = {(old, new) for old, news in EDGES.items() for new in news}
    assert edges == set(EDGE_CASES)


@pytest.mark.parametrize("edge", list(EDGE_CASES), ids=edge_ids(EDGE_CASES))
def test_edge(edge: tuple[State, State]) -> None:
    check_edge(EDGE_CASES, edge)


def test_ready_line_also_starts_warming() -> None:
    d = Drive().loading()
    assert d.send(ReadyLine(1)) == [
        Transitioned(State.LOADING, State.WARMING, "ready_line"),
        CancelTimer(TimerName.PROBE_RETRY),
        StartProbe(1, ProbeKind.READINESS),
    ]


def test_the_machine_starts_in_starting_on_primary() -> None:
    m = Machine(CFG, T0)
    assert (m.state, m.ctx.profile, m.ctx.launch, m.ctx.child) == (
        State.STARTING,
        PRIMARY,
        0,
        False,
    )
    assert m.ctx.since == T0
    assert m.ctx.backoff == CFG.restart.backoff_initial


def test_since_follows_the_clock() -> None:
    d = Drive().cleaning()
    d.send(HostReady(), after=7.5)
    assert d.m.ctx.since == T0 + 7.5


# ------------------------------------------------------------------------------ warming


def test_port_open_then_ready_line_starts_one_probe_only() -> None:
    d = Drive().loading()
    assert of(StartProbe, d.send(PortOpen(1)))
    assert d.send(ReadyLine(1)) == []  # the probe is still in flight


def test_ready_line_restarts_a_waiting_readiness_probe_at_once() -> None:
    d = Drive().warming()
    d.send(ProbeDone(1, ProbeKind.READINESS, not_up_result()))
    assert d.send(ReadyLine(1), after=0.1) == [
        CancelTimer(TimerName.PROBE_RETRY),
        StartProbe(1, ProbeKind.READINESS),
    ]


@pytest.mark.parametrize(
    ("result", "busy"),
    [(not_up_result(), False), (failed_result(), True)],
    ids=["not_up", "busy"],
)
def test_probe_not_up_or_busy_in_warming_retries(result: ProbeResult, busy: bool) -> None:
    d = Drive().warming()
    actions = d.send(ProbeDone(1, ProbeKind.READINESS, result, busy))
    assert actions == [SetTimer(TimerName.PROBE_RETRY, PROBE_RETRY_DELAY, 1)]
    assert d.state is State.WARMING
    assert d.send(TimerFired(TimerName.PROBE_RETRY, 1), after=PROBE_RETRY_DELAY) == [
        StartProbe(1, ProbeKind.READINESS)
    ]


def test_probe_retry_timer_while_a_probe_is_in_flight_does_nothing() -> None:
    d = Drive().warming()
    assert d.send(TimerFired(TimerName.PROBE_RETRY, 1)) == []


def test_readiness_keeps_retrying_until_the_load_timer() -> None:
    d = Drive().warming()
    for _ in range(20):
        d.send(ProbeDone(1, ProbeKind.READINESS, not_up_result()))
        assert d.send(TimerFired(TimerName.PROBE_RETRY, 1), after=0.25)
    actions = d.send(TimerFired(TimerName.LOAD, 1), after=1800)
    assert transitions(actions) == [(State.WARMING, State.RESTARTING)]
    assert of(Transitioned, actions)[0].reason == Reason.LOAD_TIMEOUT
    assert StopChild(1, graceful=False) in actions


@pytest.mark.parametrize(
    "reason", ["timeout", "connection_lost", "too_few_tokens", "no_speculation", "malformed"]
)
def test_any_real_failure_in_warming_is_readiness_failed(reason: str) -> None:
    d = Drive().warming()
    actions = d.send(ProbeDone(1, ProbeKind.READINESS, failed_result(reason, None)))
    t = of(Transitioned, actions)[0]
    assert (t.new, t.reason, t.detail) == (State.RESTARTING, Reason.READINESS_FAILED, reason)
    assert StopChild(1, graceful=False) in actions


def test_port_open_and_ready_line_alone_never_make_ready() -> None:
    d = Drive().loading()
    for event in (PortOpen(1), ReadyLine(1), PortOpen(1), ReadyLine(1)):
        d.send(event)
        assert d.state is State.WARMING
    assert not any(isinstance(a, NotifyReady) for a in d.send(ReadyLine(1)))


def test_a_liveness_result_in_warming_does_not_make_ready() -> None:
    d = Drive().warming()
    assert d.send(ProbeDone(1, ProbeKind.LIVENESS, ok_result())) == []
    assert d.state is State.WARMING


@pytest.mark.parametrize(
    "path", [Drive.launching, Drive.loading, Drive.warming, Drive.ready, Drive.degraded]
)
def test_load_timer_restarts_only_before_ready(path: Callable[[Drive], Drive]) -> None:
    d = path(Drive())
    actions = d.send(TimerFired(TimerName.LOAD, 1), after=1800)
    if d.m.ctx.ready_at is None:
        assert of(Transitioned, actions)[0].reason == Reason.LOAD_TIMEOUT
    else:
        assert actions == []  # a stale load timer after ready means nothing


def test_load_timer_counts_from_launched() -> None:
    d = Drive().launching()
    assert SetTimer(TimerName.LOAD, CFG.readiness.load_timeout, 1) in d.send(Launched(1, PID))


# ------------------------------------------------------------------------------ restarts


@pytest.mark.parametrize(
    ("path", "event", "reason"),
    [
        (Drive.launching, FatalLog(1, SCHEDULER_EXCEPTION), Reason.FATAL_LOG),
        (Drive.loading, ChildExited(1, 1, None), Reason.EXITED),
        (Drive.loading, FatalLog(1, "Scheduler watchdog timeout"), Reason.FATAL_LOG),
        (Drive.warming, ChildExited(1, None, 6), Reason.EXITED),
        (Drive.ready, FatalLog(1, SCHEDULER_EXCEPTION), Reason.FATAL_LOG),
        (Drive.degraded, ChildExited(1, 0, None), Reason.EXITED),
    ],
)
def test_child_exit_and_fatal_log_restart_from_every_child_state(
    path: Callable[[Drive], Drive], event: Event, reason: Reason
) -> None:
    d = path(Drive())
    old = d.state
    actions = d.send(event)
    first = of(Transitioned, actions)[0]
    assert actions[0] == Transitioned(old, State.RESTARTING, reason, first.detail)
    assert actions[1:] == [*LAUNCH_TIMERS, StopChild(1, graceful=False)]


def test_exit_detail_names_the_exit_code() -> None:
    d = Drive().ready()
    assert of(Transitioned, d.send(ChildExited(1, 137, None)))[0].detail == "exit code 137"


def test_a_worker_death_names_the_process() -> None:
    d = Drive().ready()
    actions = d.send(ChildExited(1, None, 9, process="sglang::scheduler (pid 4242)"))
    detail = "sglang::scheduler (pid 4242) killed by signal 9"
    assert of(Transitioned, actions)[0] == Transitioned(
        State.READY, State.RESTARTING, Reason.EXITED, detail
    )
    # Out of ready at once, and the launch is killed now: SGLang's own 5 s wait is not awaited.
    assert StopChild(1, graceful=False) in actions


def test_a_traceback_then_signal_9_is_fatal_log_with_the_traceback() -> None:
    # SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1: the scheduler logs its traceback and SIGKILLs the
    # group; the death can be seen before the traceback's last line is read.
    d = Drive().ready()
    d.send(ChildExited(1, None, 9, process="sglang::scheduler (pid 4242)"))
    line = "AttributeError: 'EAGLEWorkerV2' object has no attribute 'spec_disable_batch_threshold'"
    assert d.send(FatalLog(1, line)) == [
        Transitioned(State.RESTARTING, State.RESTARTING, Reason.FATAL_LOG, line)
    ]
    # The backoff runs from the restart decision: 0.1 s of it passed while the group died.
    assert d.send(ChildGone(1, None, 9), after=0.1) == [
        RecordRestart(Reason.FATAL_LOG, None, 9, line),
        SetTimer(TimerName.BACKOFF, pytest.approx(4.9), 1),
    ]


@pytest.mark.parametrize("first", [Reason.FATAL_LOG, Reason.MANUAL, Reason.LIVENESS_FAILED])
def test_a_fatal_line_does_not_rewrite_other_restarts(first: Reason) -> None:
    d = Drive().ready()
    if first is Reason.FATAL_LOG:
        d.send(FatalLog(1, "first"))
    elif first is Reason.MANUAL:
        d.send(RestartRequested(Reason.MANUAL))
    else:
        for _ in range(CFG.liveness.failure_threshold):
            d.liveness(failed_result())
    assert d.state is State.RESTARTING and d.m.ctx.pending is first
    assert d.send(FatalLog(1, "later")) == []
    assert d.m.ctx.pending is first


def test_a_fatal_line_after_the_launch_is_gone_changes_nothing() -> None:
    d = Drive().backing_off()
    assert d.send(FatalLog(1, SCHEDULER_EXCEPTION)) == []


def test_child_gone_after_a_crash_records_and_backs_off() -> None:
    d = Drive().restarting()
    # 2 s of the 5 s backoff passed while the old launch's processes went.
    assert d.send(ChildGone(1, None, 9), after=2) == [
        RecordRestart(Reason.EXITED, None, 9, "killed by signal 9"),
        SetTimer(TimerName.BACKOFF, 3.0, 1),
    ]
    assert d.state is State.RESTARTING and not d.m.ctx.child


def test_events_while_restarting_do_not_restart_twice() -> None:
    d = Drive().restarting()
    for event in events(
        ChildExited(1, None, 9),
        ProbeDone(1, ProbeKind.LIVENESS, failed_result()),
        TimerFired(TimerName.LOAD, 1),
        TimerFired(TimerName.LIVENESS, 1),
        PortOpen(1),
    ):
        assert d.send(event) == [], event


def test_backoff_doubles_and_is_capped_at_backoff_max() -> None:
    d = Drive(make_cfg(max_restarts=100, backoff_initial="5s", backoff_max="1m")).ready()
    delays = []
    for _ in range(7):
        delays += backoff_delays(d.crash())
        d.backoff_elapsed()
        d.bring_up()
    assert delays == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]


def test_backoff_zero_stays_zero() -> None:
    d = Drive(make_cfg(max_restarts=100, backoff_initial="0s")).ready()
    delays = []
    for _ in range(3):
        delays += backoff_delays(d.crash())
        d.backoff_elapsed()
        d.bring_up()
    assert delays == [0.0, 0.0, 0.0]


def test_stable_after_resets_the_backoff() -> None:
    d = Drive(make_cfg(max_restarts=100, stable_after="10m")).ready()
    assert backoff_delays(d.crash()) == [5.0]
    d.backoff_elapsed()
    d.bring_up()
    assert backoff_delays(d.crash(after=30)) == [10.0]
    d.backoff_elapsed()
    d.bring_up()
    # This launch serves for 10 minutes: the next restart starts from backoff_initial again.
    assert backoff_delays(d.crash(after=600)) == [5.0]
    d.backoff_elapsed()
    d.bring_up()
    assert backoff_delays(d.crash(after=1)) == [10.0]


def test_stability_is_measured_from_ready_not_from_launch() -> None:
    d = Drive(make_cfg(max_restarts=100, stable_after="10m")).ready()
    assert backoff_delays(d.crash()) == [5.0]
    d.backoff_elapsed()
    # 20 minutes of loading, then 1 minute of serving: not stable.
    d.send(HostReady())
    d.send(Launched(d.launch, PID))
    d.send(PortOpen(d.launch), after=1200)
    d.send(ProbeDone(d.launch, ProbeKind.READINESS, ok_result()))
    assert backoff_delays(d.crash(after=60)) == [10.0]


def _crash_loop(d: Drive, n: int) -> list[Action]:
    """n crashes a minute apart, each relaunched; returns the actions of the last ChildGone."""
    actions: list[Action] = []
    for i in range(n):
        actions = d.crash(after=60)
        if i < n - 1:
            d.backoff_elapsed()
            d.bring_up()
    return actions


def test_crash_loop_switches_to_the_fallback_and_clears_history() -> None:
    d = Drive(make_cfg(max_restarts=3)).ready()
    actions = _crash_loop(d, 3)
    assert actions == [
        RecordRestart(Reason.EXITED, None, 9, "killed by signal 9"),
        ProfileChanged(PRIMARY, FALLBACK),
        SetTimer(TimerName.BACKOFF, 5.0, d.launch),  # fresh backoff on the new profile
    ]
    assert d.m.ctx.profile == FALLBACK
    assert len(d.m.ctx.restarts) == 0
    d.backoff_elapsed()
    assert of(Launch, d.bring_up()) == [Launch(4, FALLBACK)]


def test_crash_loop_on_the_fallback_fails() -> None:
    d = Drive(make_cfg(max_restarts=3)).ready()
    _crash_loop(d, 3)
    d.backoff_elapsed()
    d.bring_up()
    actions = _crash_loop(d, 3)
    assert actions == [
        RecordRestart(Reason.EXITED, None, 9, "killed by signal 9"),
        Transitioned(
            State.RESTARTING,
            State.FAILED,
            "crash_loop",
            "3 restarts within 3600s on profile fallback",
        ),
    ]
    assert not of(SetTimer, actions)


def test_crash_loop_without_fallback_fails_on_primary() -> None:
    d = Drive(make_cfg(max_restarts=3, fallback=None)).ready()
    actions = _crash_loop(d, 3)
    assert transitions(actions) == [(State.RESTARTING, State.FAILED)]
    assert not of(ProfileChanged, actions)
    assert d.m.ctx.profile == PRIMARY


def test_one_restart_short_of_the_loop_keeps_backing_off() -> None:
    d = Drive(make_cfg(max_restarts=3)).ready()
    actions = _crash_loop(d, 2)
    assert backoff_delays(actions) == [10.0]
    assert d.m.ctx.profile == PRIMARY


def test_restarts_outside_the_window_do_not_count() -> None:
    d = Drive(make_cfg(max_restarts=3, window="1h", stable_after="1000h")).ready()
    for _ in range(6):
        actions = d.crash(after=1801)  # two restarts fit in any hour, never three
        assert not of(ProfileChanged, actions) and d.state is State.RESTARTING
        d.backoff_elapsed()
        d.bring_up()
    assert d.m.ctx.profile == PRIMARY


@pytest.mark.parametrize(("gap", "loop"), [(100.0, True), (100.5, False)])
def test_the_window_edge(gap: float, loop: bool) -> None:
    d = Drive(make_cfg(max_restarts=2, window="100s")).ready()
    d.crash(after=1)
    first = d.now
    d.backoff_elapsed()
    d.bring_up()
    d.now = first + gap  # the next crash's ChildGone lands `gap` seconds later
    changed = of(ProfileChanged, d.crash(after=0))
    assert changed == ([ProfileChanged(PRIMARY, FALLBACK)] if loop else [])


@pytest.mark.parametrize(
    ("path", "event", "reason"),
    [
        (Drive.loading, TimerFired(TimerName.LOAD, 1), Reason.LOAD_TIMEOUT),
        (Drive.warming, ProbeDone(1, ProbeKind.READINESS, ZERO_TOKENS), Reason.READINESS_FAILED),
        (Drive.ready, FatalLog(1, SCHEDULER_EXCEPTION), Reason.FATAL_LOG),
    ],
)
def test_every_failure_reason_counts_towards_the_crash_loop(
    path: Callable[[Drive], Drive], event: Event, reason: Reason
) -> None:
    d = path(Drive(make_cfg(max_restarts=1, fallback=None)))
    d.send(event)
    actions = d.send(ChildGone(1, None, 9))
    assert of(RecordRestart, actions)[0].reason is reason
    assert transitions(actions) == [(State.RESTARTING, State.FAILED)]


# ------------------------------------------------------------------------------ liveness


def test_liveness_timer_starts_a_liveness_probe() -> None:
    d = Drive().ready()
    assert d.send(TimerFired(TimerName.LIVENESS, 1), after=15) == [
        StartProbe(1, ProbeKind.LIVENESS)
    ]
    assert d.send(TimerFired(TimerName.LIVENESS, 1), after=15) == []  # one at a time


def test_liveness_ok_keeps_ready_and_rearms() -> None:
    d = Drive().ready()
    assert d.liveness(ok_result()) == [SetTimer(TimerName.LIVENESS, 15.0, 1)]
    assert d.state is State.READY


def test_liveness_failures_below_threshold_degrade_then_threshold_restarts() -> None:
    d = Drive(make_cfg(threshold=3)).ready()
    first = d.liveness(failed_result())
    assert transitions(first) == [(State.READY, State.DEGRADED)]
    second = d.liveness(failed_result())
    assert second == [
        Transitioned(State.DEGRADED, State.DEGRADED, "probe_failed", "no answer within 20s (2/3)"),
        SetTimer(TimerName.LIVENESS, 15.0, 1),
    ]
    third = d.liveness(failed_result())
    assert third == [
        Transitioned(
            State.DEGRADED, State.RESTARTING, "liveness_failed", "no answer within 20s (3/3)"
        ),
        *LAUNCH_TIMERS,
        StopChild(1, graceful=False),
    ]


def test_liveness_recovery_resets_the_count() -> None:
    d = Drive(make_cfg(threshold=3)).ready()
    d.liveness(failed_result())
    d.liveness(failed_result())
    assert transitions(d.liveness(ok_result())) == [(State.DEGRADED, State.READY)]
    assert d.m.ctx.liveness_failures == 0
    d.liveness(failed_result())
    d.liveness(failed_result())
    assert d.state is State.DEGRADED  # 2/3 again, not 4/3


def test_threshold_one_restarts_straight_from_ready() -> None:
    d = Drive(make_cfg(threshold=1)).ready()
    assert transitions(d.liveness(failed_result())) == [(State.READY, State.RESTARTING)]


def test_a_busy_liveness_failure_is_not_counted() -> None:
    d = Drive(make_cfg(threshold=2)).ready()
    for _ in range(10):
        assert d.liveness(failed_result(), busy=True) == [SetTimer(TimerName.LIVENESS, 15.0, 1)]
    assert d.state is State.READY and d.m.ctx.liveness_failures == 0


def test_busy_does_not_reset_earlier_failures() -> None:
    d = Drive(make_cfg(threshold=2)).ready()
    d.liveness(failed_result())
    d.liveness(failed_result(), busy=True)
    assert d.state is State.DEGRADED
    assert transitions(d.liveness(failed_result())) == [(State.DEGRADED, State.RESTARTING)]


def test_not_up_after_ready_is_a_liveness_failure() -> None:
    d = Drive(make_cfg(threshold=1)).ready()
    assert transitions(d.liveness(not_up_result())) == [(State.READY, State.RESTARTING)]


def test_liveness_failures_start_from_zero_on_a_new_launch() -> None:
    d = Drive(make_cfg(threshold=3, max_restarts=100)).ready()
    d.liveness(failed_result())
    d.liveness(failed_result())
    d.crash()
    d.backoff_elapsed()
    d.bring_up()
    d.liveness(failed_result())
    assert d.state is State.DEGRADED and d.m.ctx.liveness_failures == 1


def test_a_readiness_result_after_ready_is_ignored() -> None:
    d = Drive().ready()
    assert d.send(ProbeDone(1, ProbeKind.READINESS, ZERO_TOKENS)) == []
    assert d.state is State.READY


# ------------------------------------------------------------------------------ requests


def test_manual_restart_in_ready_is_graceful_without_backoff_and_not_counted() -> None:
    d = Drive(make_cfg(max_restarts=2)).ready()
    assert d.send(RestartRequested(Reason.MANUAL)) == [
        Transitioned(State.READY, State.RESTARTING, "manual", "requested"),
        *LAUNCH_TIMERS,
        StopChild(1, graceful=True),
    ]
    assert d.send(ChildGone(1, 0, None), after=4) == [
        RecordRestart(Reason.MANUAL, 0, None, "requested"),
        Transitioned(State.RESTARTING, State.CLEANING, "manual"),
        CleanHost(),
    ]
    assert len(d.m.ctx.restarts) == 0
    # Many manual restarts never make a crash loop.
    for _ in range(5):
        d.bring_up()
        d.send(RestartRequested(Reason.MANUAL))
        assert of(ProfileChanged, d.send(ChildGone(d.launch, 0, None))) == []
    assert d.m.ctx.profile == PRIMARY


@pytest.mark.parametrize("path", [Drive.launching, Drive.loading, Drive.warming, Drive.degraded])
def test_requested_restart_in_any_child_state_is_graceful(path: Callable[[Drive], Drive]) -> None:
    d = path(Drive())
    old = d.state
    actions = d.send(RestartRequested(Reason.RELOAD))
    assert transitions(actions) == [(old, State.RESTARTING)]
    assert actions[-1] == StopChild(1, graceful=True)


def test_reload_back_to_primary_on_the_fallback() -> None:
    d = Drive(make_cfg(max_restarts=1)).ready()
    d.crash()
    assert d.m.ctx.profile == FALLBACK
    d.backoff_elapsed()
    d.bring_up()
    actions = d.send(RestartRequested(Reason.RELOAD, back_to_primary=True))
    assert actions == [
        ProfileChanged(FALLBACK, PRIMARY),
        Transitioned(State.READY, State.RESTARTING, "reload", "requested"),
        *LAUNCH_TIMERS,
        StopChild(d.launch, graceful=True),
    ]
    gone = d.send(ChildGone(d.launch, 0, None))
    assert transitions(gone) == [(State.RESTARTING, State.CLEANING)]
    assert of(Launch, d.bring_up()) == [Launch(d.launch, PRIMARY)]


def _on_the_fallback() -> Drive:
    d = Drive(make_cfg(max_restarts=1)).ready()
    d.crash()
    assert d.m.ctx.profile == FALLBACK
    d.backoff_elapsed()
    d.bring_up()
    return d


def test_a_manual_restart_relaunches_on_primary() -> None:
    # The runbook's "back to primary": `kimi-serve restart` after the fix.
    d = _on_the_fallback()
    actions = d.send(RestartRequested(Reason.MANUAL))
    assert actions[0] == ProfileChanged(FALLBACK, PRIMARY)
    assert actions[-1] == StopChild(d.launch, graceful=True)
    d.send(ChildGone(d.launch, 0, None))
    assert of(Launch, d.bring_up()) == [Launch(d.launch, PRIMARY)]


def test_a_manual_restart_while_failed_on_the_fallback_relaunches_on_primary() -> None:
    d = _on_the_fallback()
    d.crash()
    d.expect(State.FAILED)
    assert d.send(RestartRequested(Reason.MANUAL))[0] == ProfileChanged(FALLBACK, PRIMARY)
    assert of(Launch, d.bring_up()) == [Launch(d.launch, PRIMARY)]


def test_an_unchanged_reload_on_the_fallback_relaunches_on_primary() -> None:
    d = _on_the_fallback()
    assert not d.m.stays_ready(Verdict.UNCHANGED)
    actions = d.send(ConfigRead(Verdict.UNCHANGED))
    assert actions[:2] == [NotifyReloaded(True), ProfileChanged(FALLBACK, PRIMARY)]
    assert actions[-1] == StopChild(d.launch, graceful=True)
    d.send(ChildGone(d.launch, 0, None))
    assert of(Launch, d.bring_up()) == [Launch(d.launch, PRIMARY)]


def test_back_to_primary_on_primary_changes_no_profile() -> None:
    d = Drive().ready()
    actions = d.send(RestartRequested(Reason.RELOAD, back_to_primary=True))
    assert not of(ProfileChanged, actions)


def test_back_to_primary_clears_the_crash_history() -> None:
    d = Drive(make_cfg(max_restarts=3, fallback=None)).ready()
    _crash_loop(d, 2)
    d.backoff_elapsed()
    d.bring_up()
    d.send(RestartRequested(Reason.RELOAD, back_to_primary=True))
    d.send(ChildGone(d.launch, 0, None))
    d.bring_up()
    assert transitions(d.crash()) == []  # 1 of 3, not 3 of 3


@pytest.mark.parametrize("reason", [Reason.MANUAL, Reason.RELOAD])
def test_requested_restart_during_backoff_goes_now(reason: Reason) -> None:
    d = Drive().backing_off()
    assert d.send(RestartRequested(reason)) == [
        CancelTimer(TimerName.BACKOFF),
        Transitioned(State.RESTARTING, State.CLEANING, reason),
        CleanHost(),
    ]


def test_requested_restart_while_the_old_child_is_still_stopping_waits() -> None:
    d = Drive().restarting()
    assert d.send(RestartRequested(Reason.MANUAL)) == []
    assert d.state is State.RESTARTING


@pytest.mark.parametrize("path", [lambda d: d, Drive.cleaning])
def test_requested_restart_before_any_launch_does_nothing(path: Callable[[Drive], Drive]) -> None:
    d = path(Drive())
    state = d.state
    assert d.send(RestartRequested(Reason.MANUAL)) == []
    assert d.state is state


def test_reload_in_failed_relaunches_on_the_same_profile_with_fresh_history() -> None:
    d = Drive(make_cfg(max_restarts=1)).ready()
    d.crash()  # -> fallback
    d.backoff_elapsed()
    d.bring_up()
    d.crash()  # -> failed
    assert d.state is State.FAILED
    actions = d.send(RestartRequested(Reason.RELOAD))
    assert actions == [
        RecordRestart(Reason.RELOAD, None, None, "requested"),
        Transitioned(State.FAILED, State.CLEANING, "reload"),
        CleanHost(),
    ]
    assert d.m.ctx.profile == FALLBACK and len(d.m.ctx.restarts) == 0
    assert d.m.ctx.backoff == 5.0


def test_reload_back_to_primary_in_failed() -> None:
    d = Drive(make_cfg(max_restarts=1)).ready()
    d.crash()
    d.backoff_elapsed()
    d.bring_up()
    d.crash()
    actions = d.send(RestartRequested(Reason.RELOAD, back_to_primary=True))
    assert actions[0] == ProfileChanged(FALLBACK, PRIMARY)
    assert of(Launch, d.bring_up()) == [Launch(d.launch, PRIMARY)]


# ------------------------------------------------------------------------------ failed


def _failed_by_crash_loop() -> Drive:
    d = Drive(make_cfg(max_restarts=1, fallback=None)).ready()
    d.crash()
    return d.expect(State.FAILED)


@pytest.mark.parametrize("make", [Drive.failed, lambda _: _failed_by_crash_loop()])
def test_failed_ignores_everything_but_requests_and_stop(make: Callable[[Drive], Drive]) -> None:
    d = make(Drive())
    n = d.launch
    for launch in (n, n + 1, n - 1):
        for event in events(
            Start(),
            HostReady(),
            HostNotReady("port busy"),
            HostNotReady("stuck", wedged=True),
            Launched(launch, PID),
            LaunchFailed(launch, "boom"),
            PortOpen(launch),
            ReadyLine(launch),
            FatalLog(launch, SCHEDULER_EXCEPTION),
            ProbeDone(launch, ProbeKind.READINESS, ok_result()),
            ProbeDone(launch, ProbeKind.LIVENESS, ok_result()),
            ChildExited(launch, 1, None),
            ChildGone(launch, 1, None),
            *(TimerFired(name, launch) for name in TimerName),
        ):
            assert d.send(event, after=3600) == [], event
            assert d.state is State.FAILED
    assert transitions(d.send(RestartRequested(Reason.MANUAL))) == [(State.FAILED, State.CLEANING)]


# ------------------------------------------------------------------------------ cleaning


def test_host_not_ready_retries_with_backoff_and_a_status_update() -> None:
    d = Drive().cleaning()
    msg = "GPU 3 still holds 70 GiB after 60s"
    assert d.send(HostNotReady(msg)) == [
        Transitioned(State.CLEANING, State.CLEANING, "host_not_ready", msg),
        SetTimer(TimerName.CLEAN_RETRY, 5.0, 0),
    ]
    assert d.m.ctx.host_message == msg
    assert d.send(TimerFired(TimerName.CLEAN_RETRY, 0), after=5) == [CleanHost()]
    second = d.send(HostNotReady("127.0.0.1:30000 held by pid 99 (sglang.port)"))
    assert of(SetTimer, second) == [SetTimer(TimerName.CLEAN_RETRY, 10.0, 0)]
    d.send(TimerFired(TimerName.CLEAN_RETRY, 0), after=10)
    assert transitions(d.send(HostReady())) == [(State.CLEANING, State.LAUNCHING)]
    assert d.m.ctx.host_message == ""


def test_clean_retry_is_capped_at_backoff_max() -> None:
    d = Drive(make_cfg(backoff_max="20s")).cleaning()
    delays = [of(SetTimer, d.send(HostNotReady("busy")))[0].delay for _ in range(5)]
    assert delays == [5.0, 10.0, 20.0, 20.0, 20.0]


def test_host_not_ready_wedged_fails() -> None:
    d = Drive().cleaning()
    actions = d.send(HostNotReady("process 77 survives SIGKILL", wedged=True))
    assert transitions(actions) == [(State.CLEANING, State.FAILED)]
    assert not of(SetTimer, actions)


def test_a_missing_model_waits_and_retries_outside_the_crash_loop() -> None:
    # A mount that comes late: retried with the cleaning's own backoff for as long as it takes,
    # one state (`waiting`, reason model_missing), and no restart counted.
    d = Drive(make_cfg(max_restarts=1, backoff_max="20s")).waiting()
    delays = []
    for _ in range(6):
        assert d.send(TimerFired(TimerName.CLEAN_RETRY, 0), after=60) == [CleanHost()]
        actions = d.send(HostNotReady(MISSING, model_missing=True))
        assert actions[0] == Transitioned(State.WAITING, State.WAITING, "model_missing", MISSING)
        delays.append(of(SetTimer, actions)[0].delay)
    assert delays == [10.0, 20.0, 20.0, 20.0, 20.0, 20.0]
    assert not d.m.ctx.restarts and d.m.ctx.host_message == MISSING
    assert not of(RecordRestart, actions)
    d.send(TimerFired(TimerName.CLEAN_RETRY, 0), after=20)
    assert transitions(d.send(HostReady())) == [(State.WAITING, State.LAUNCHING)]
    assert d.m.ctx.host_retries == 0


def test_waiting_ignores_a_restart_request_and_extends_the_start_job() -> None:
    d = Drive().waiting()
    assert d.send(RestartRequested(Reason.MANUAL)) == []
    assert d.m.job_extension() is not None


def test_clean_retry_outside_cleaning_is_ignored() -> None:
    d = Drive().ready()
    assert d.send(TimerFired(TimerName.CLEAN_RETRY, 1)) == []


# ------------------------------------------------------------------------------ stopping


STOP_PATHS: dict[str, tuple[Callable[[Drive], Drive], bool]] = {
    "starting": (lambda d: d, False),
    "cleaning": (Drive.cleaning, False),
    "waiting": (Drive.waiting, False),
    "launching": (Drive.launching, True),
    "loading": (Drive.loading, True),
    "warming": (Drive.warming, True),
    "ready": (Drive.ready, True),
    "degraded": (Drive.degraded, True),
    "draining": (Drive.draining, True),
    "restarting-child": (Drive.restarting, True),
    "restarting-backoff": (Drive.backing_off, False),
    "failed": (Drive.failed, False),
}


def test_stop_paths_cover_every_state_but_the_stop_states() -> None:
    covered = {path(Drive()).state for path, _ in STOP_PATHS.values()}
    assert covered == set(State) - {State.STOPPING, State.STOPPED}


@pytest.mark.parametrize("name", list(STOP_PATHS))
def test_stop_requested_from_every_state(name: str) -> None:
    path, child = STOP_PATHS[name]
    d = path(Drive())
    old = d.state
    actions = d.send(StopRequested())
    head = [Transitioned(old, State.STOPPING, "SIGTERM"), *ALL_TIMERS]
    if child:
        assert actions == [*head, StopChild(d.launch, graceful=True)]
        assert d.state is State.STOPPING
        assert d.send(ChildGone(d.launch, 0, None), after=2) == [
            Transitioned(State.STOPPING, State.STOPPED, "child_stopped"),
            Exit(0),
        ]
    else:
        assert actions == [
            *head,
            Transitioned(State.STOPPING, State.STOPPED, "no_child"),
            Exit(0),
        ]
    assert d.state is State.STOPPED


def test_second_stop_while_stopping_kills() -> None:
    d = Drive().stopping()
    assert d.send(StopRequested("SIGINT")) == [StopChild(1, graceful=False)]
    assert d.send(StopRequested("SIGTERM")) == [StopChild(1, graceful=False)]
    assert d.state is State.STOPPING


def test_stopping_ignores_everything_but_child_gone() -> None:
    d = Drive().stopping()
    for event in events(
        Start(),
        HostReady(),
        Launched(1, PID),
        PortOpen(1),
        ReadyLine(1),
        FatalLog(1, SCHEDULER_EXCEPTION),
        ChildExited(1, 0, None),
        ProbeDone(1, ProbeKind.LIVENESS, ok_result()),
        ProbeDone(1, ProbeKind.READINESS, ok_result()),
        RestartRequested(Reason.MANUAL),
        RestartRequested(Reason.RELOAD, back_to_primary=True),
        *(TimerFired(name, 1) for name in TimerName),
        ChildGone(0, 0, None),
    ):
        assert d.send(event) == [], event
        assert d.state is State.STOPPING
    assert of(Exit, d.send(ChildGone(1, 0, None))) == [Exit(0)]


def test_stopped_is_final() -> None:
    d = Drive().stopped()
    for event in events(
        StopRequested(),
        StopRequested("SIGINT"),
        Start(),
        RestartRequested(Reason.MANUAL),
        ChildGone(1, 0, None),
        HostReady(),
        TimerFired(TimerName.BACKOFF, 1),
    ):
        assert d.send(event) == [], event
        assert d.state is State.STOPPED


# ------------------------------------------------------------------------------ stale events


def _relaunched() -> Drive:
    """Launch 1 crashed and is gone; launch 2 is ready."""
    d = Drive().ready()
    d.crash()
    d.backoff_elapsed()
    d.bring_up()
    assert d.launch == 2
    return d


STALE = [
    Launched(1, PID),
    LaunchFailed(1, "boom"),
    PortOpen(1),
    ReadyLine(1),
    FatalLog(1, SCHEDULER_EXCEPTION),
    ProbeDone(1, ProbeKind.READINESS, ZERO_TOKENS),
    ProbeDone(1, ProbeKind.LIVENESS, failed_result()),
    ChildExited(1, None, 9),
    ChildGone(1, None, 9),
    TimerFired(TimerName.LOAD, 1),
    TimerFired(TimerName.LIVENESS, 1),
    TimerFired(TimerName.BACKOFF, 1),
    TimerFired(TimerName.PROBE_RETRY, 1),
]


@pytest.mark.parametrize("event", STALE, ids=[type(e).__name__ for e in STALE])
@pytest.mark.parametrize("where", ["ready", "degraded", "warming"])
def test_events_of_an_old_launch_are_ignored(event: Event, where: str) -> None:
    d = _relaunched()
    if where == "degraded":
        d.liveness(failed_result())
    elif where == "warming":
        d.send(ChildExited(2, None, 9))
        d.send(ChildGone(2, None, 9))
        d.backoff_elapsed()
        d.send(HostReady())
        d.send(Launched(3, PID))
        d.send(PortOpen(3))
    state, child, failures = d.state, d.m.ctx.child, d.m.ctx.liveness_failures
    assert d.send(event) == []
    assert (d.state, d.m.ctx.child, d.m.ctx.liveness_failures) == (state, child, failures)


def test_events_of_a_future_launch_are_ignored() -> None:
    d = Drive().warming()
    assert d.send(ProbeDone(2, ProbeKind.READINESS, ok_result())) == []
    assert d.send(ChildExited(2, 1, None)) == []
    assert d.state is State.WARMING


def test_a_stale_backoff_timer_does_not_skip_the_next_backoff() -> None:
    d = Drive(make_cfg(max_restarts=100)).ready()
    d.crash()
    d.send(RestartRequested(Reason.MANUAL))  # goes now; the backoff timer may already be queued
    assert d.send(TimerFired(TimerName.BACKOFF, 1)) == []
    assert d.state is State.CLEANING


# -------------------------------------------------------- stale and out-of-order events


def test_late_launch_failed_in_cleaning_is_ignored() -> None:
    d = Drive().launching()
    d.send(RestartRequested(Reason.MANUAL))
    # The machine drops stale events by contract; this order must not crash the daemon's loop.
    d.send(ChildGone(1, None, None))
    d.expect(State.CLEANING)
    assert d.send(LaunchFailed(1, "cannot start python")) == []


def test_launch_failed_before_any_launch_is_ignored() -> None:
    assert Drive().send(LaunchFailed(0, "boom")) == []


@pytest.mark.parametrize("path", [Drive.loading, Drive.ready])
def test_child_gone_without_a_stop_restarts(path: Callable[[Drive], Drive]) -> None:
    d = path(Drive())
    old = d.state
    actions = d.send(ChildGone(1, 1, None))
    assert transitions(actions) == [(old, State.RESTARTING)]
    assert RecordRestart(Reason.EXITED, 1, None, "exit code 1") in actions


def test_backoff_timer_waits_for_the_old_child() -> None:
    d = Drive().ready()
    d.send(RestartRequested(Reason.MANUAL))
    assert d.m.ctx.child
    assert d.send(TimerFired(TimerName.BACKOFF, 1)) == []
    assert d.state is State.RESTARTING


def test_duplicate_child_gone_is_not_a_second_restart() -> None:
    d = Drive(make_cfg(max_restarts=2, fallback=None)).restarting()
    d.send(ChildGone(1, None, 9))
    assert d.send(ChildGone(1, None, 9)) == []
    assert d.state is State.RESTARTING


# ------------------------------------------------------------------------------ properties


@settings(SETTINGS, max_examples=50)
@given(data=st.data(), cfg=st.sampled_from(CONFIGS), steps=st.integers(1, 120))
def testdaemon_like_runs_keep_every_invariant(data: Any, cfg: Config, steps: int) -> None:
    daemon_like_run(data, cfg, steps)


def testdaemon_like_runs_from_a_fixed_seed_reach_every_edge() -> None:
    """The same property on 200 fixed runs, which must between them take every edge: random
    runs are only as good as what they reach."""
    edges: set[tuple[State, State]] = set()

    @settings(SETTINGS, derandomize=True, max_examples=500)
    @given(data=st.data(), cfg=st.sampled_from(CONFIGS), steps=st.integers(20, 120))
    def run(data: Any, cfg: Config, steps: int) -> None:
        edges.update(daemon_like_run(data, cfg, steps).inv.edges)

    run()
    assert {(a, b) for a, b in edges if a is not b} == {
        (old, new) for old, news in EDGES.items() for new in news
    }


# Arbitrary events in arbitrary order, launch ids around the current one.
KINDS = [
    "start",
    "host_ready",
    "host_not_ready",
    "launched",
    "launch_failed",
    "port",
    "ready_line",
    "fatal",
    "probe",
    "exited",
    "gone",
    "timer",
    "stop",
    "restart",
    "drain",
    "undrain",
]


def _any_event(data: Any, m: Machine) -> Event:
    kind = data.draw(st.sampled_from(KINDS))
    launch = m.ctx.launch + data.draw(st.sampled_from([0, 0, 0, -1, 1]))
    match kind:
        case "start":
            return Start()
        case "host_ready":
            return HostReady()
        case "host_not_ready":
            return HostNotReady("busy", data.draw(st.booleans()), data.draw(st.booleans()))
        case "launched":
            return Launched(launch, PID)
        case "launch_failed":
            return LaunchFailed(launch, "boom")
        case "port":
            return PortOpen(launch)
        case "ready_line":
            return ReadyLine(launch)
        case "fatal":
            return FatalLog(launch, SCHEDULER_EXCEPTION)
        case "probe":
            kind_ = data.draw(st.sampled_from(list(ProbeKind)))
            return ProbeDone(launch, kind_, data.draw(RESULTS), data.draw(st.booleans()))
        case "exited":
            return ChildExited(launch, data.draw(st.sampled_from([None, 0, 1])), None)
        case "gone":
            return ChildGone(launch, None, data.draw(st.sampled_from([None, 9])))
        case "timer":
            name = data.draw(st.sampled_from(list(TimerName)))
            return TimerFired(name, launch)
        case "stop":
            return StopRequested()
        case "drain":
            return DrainRequested()
        case "undrain":
            return UndrainRequested()
        case _:
            reason = data.draw(st.sampled_from([Reason.MANUAL, Reason.RELOAD]))
            return RestartRequested(reason, data.draw(st.booleans()))


def _arbitrary_run(data: Any, cfg: Config, n: int) -> Invariants:
    inv = Invariants(Machine(cfg, T0))
    now = T0
    for _ in range(n):
        now += data.draw(st.sampled_from([0.0, 0.25, 5.0, 60.0, 700.0, 4000.0]))
        inv.handle(_any_event(data, inv.m), now)
    return inv


@SETTINGS
@given(data=st.data(), cfg=st.sampled_from(CONFIGS), n=st.integers(1, 100))
def test_arbitrary_events_keep_every_invariant(data: Any, cfg: Config, n: int) -> None:
    _arbitrary_run(data, cfg, n)


@settings(SETTINGS, derandomize=True, phases=[Phase.generate])
@given(data=st.data(), cfg=st.sampled_from(CONFIGS), n=st.integers(1, 80))
def test_arbitrary_events_from_a_fixed_seed(data: Any, cfg: Config, n: int) -> None:
    _arbitrary_run(data, cfg, n)


def test_a_child_stuck_after_sigkill_ends_in_failed_not_a_relaunch() -> None:
    d = Drive().ready()
    d.send(ChildExited(1, None, 9))
    actions = d.send(ChildGone(1, None, 9, stuck=(4242,)))
    assert d.state is State.FAILED
    assert any(isinstance(a, RecordRestart) and a.reason is Reason.EXITED for a in actions)
    assert not any(isinstance(a, (SetTimer, CleanHost, Launch)) for a in actions)
    failed = [a for a in actions if isinstance(a, Transitioned) and a.new is State.FAILED]
    assert failed and "4242" in failed[0].detail


def test_a_child_stuck_at_stop_exits_1() -> None:
    d = Drive().ready()
    d.send(StopRequested())
    actions = d.send(ChildGone(1, None, 9, stuck=(4242,)))
    assert d.state is State.STOPPED
    assert Exit(1) in actions


# ------------------------------------------------------------------ decisions moved from the daemon


def test_reload_before_the_first_ready_sends_no_reloading() -> None:
    d = Drive().loading()
    assert d.send(ReloadRequested()) == [ReadConfig()]


def test_reload_after_ready_opens_a_reload_job() -> None:
    d = Drive().ready()
    assert d.send(ReloadRequested()) == [NotifyReloading(), ReadConfig()]


def test_ever_ready_stays_through_a_restart() -> None:
    d = Drive().ready()
    d.crash()
    assert d.m.ctx.ever_ready
    assert d.send(ReloadRequested()) == [NotifyReloading(), ReadConfig()]


def test_an_invalid_reload_keeps_everything_and_says_so() -> None:
    d = Drive().ready()
    assert d.send(ConfigRead(Verdict.INVALID)) == [
        NotifyReloaded(True, " (reload refused: config invalid)")
    ]
    d.expect(State.READY)


def test_an_invalid_reload_before_ready_is_only_a_status() -> None:
    d = Drive().warming()
    assert d.send(ConfigRead(Verdict.INVALID)) == [
        NotifyReloaded(False, " (reload refused: config invalid)")
    ]


def test_an_unchanged_reload_does_nothing_while_serving() -> None:
    d = Drive().ready()
    assert d.send(ConfigRead(Verdict.UNCHANGED)) == [NotifyReloaded(True)]
    d.expect(State.READY)


def test_an_unchanged_reload_while_failed_relaunches() -> None:
    # `failed` lasts until a reload: the operator fixed the host, not the file.
    d = Drive().failed()
    actions = d.send(ConfigRead(Verdict.UNCHANGED))
    assert actions[0] == NotifyReloaded(False)
    assert RecordRestart(Reason.RELOAD, None, None, "requested") in actions
    assert actions[-1] == CleanHost()
    d.expect(State.CLEANING)


def test_a_changed_reload_restarts_gracefully_on_the_primary_profile() -> None:
    d = Drive().ready()
    actions = d.send(ConfigRead(Verdict.CHANGED))
    assert actions[0] == NotifyReloaded(True)
    assert actions[-1] == StopChild(1, graceful=True)
    d.expect(State.RESTARTING)


def test_restart_requests_are_refused_only_while_stopping() -> None:
    for path in (Drive.cleaning, Drive.ready, Drive.failed, Drive.restarting):
        assert path(Drive()).m.refuse_restart() is None
    assert Drive().stopping().m.refuse_restart() == "the daemon is stopping"
    assert Drive().stopped().m.refuse_restart() == "the daemon is stopping"


@pytest.mark.parametrize(
    ("old", "new", "port", "tree"),
    [
        (State.CLEANING, State.LAUNCHING, False, False),
        (State.LAUNCHING, State.LOADING, False, False),
        (State.LOADING, State.WARMING, True, True),
        (State.LOADING, State.RESTARTING, True, False),
        (State.LAUNCHING, State.STOPPING, True, False),
        (State.WARMING, State.READY, True, True),
        (State.READY, State.RESTARTING, True, False),
        (State.RESTARTING, State.CLEANING, True, True),
    ],
)
def test_which_watchers_a_transition_ends(old: State, new: State, port: bool, tree: bool) -> None:
    # The port watcher matters only until the port opened; the tree recorder is kept while a
    # stop may still need to find the launch's descendants.
    assert watches_end(Transitioned(old, new, "x")) == WatchesEnd(port=port, tree=tree)


def test_a_settled_traceback_of_an_earlier_launch_is_dropped() -> None:
    # The log pump turns a settled traceback into FatalLog for the launch that printed it.
    d = Drive().ready()
    old = d.launch
    d.crash()
    d.backoff_elapsed()
    d.bring_up()
    assert d.send(FatalLog(old, SCHEDULER_EXCEPTION)) == []
    d.expect(State.READY)


# ------------------------------------------------------------------ restart.mode: exit

EXIT_CFG = make_cfg(mode="exit")
GONE = ChildGone(1, None, 9)


def _unasked(path: Callable[[Drive], Drive], *steps: Event) -> Callable[[], Any]:
    """A path in exit mode, then the events that end the launch without anyone asking; gives
    the driver and the actions of the last step (the one after which SGLang is gone)."""

    def run() -> tuple[Drive, list[Action]]:
        d = path(Drive(EXIT_CFG))
        actions: list[Action] = []
        for event in steps:
            actions = d.send(event, after=1)
        return d, actions

    return run


# Every way a launch ends unasked: the steps, the reason recorded, a piece of its detail.
UNASKED: dict[str, tuple[Callable[[], Any], Reason, str]] = {
    "exit while ready": (
        _unasked(Drive.ready, ChildExited(1, None, 9), GONE),
        Reason.EXITED,
        "killed by signal 9",
    ),
    "fatal line while loading": (
        _unasked(Drive.loading, FatalLog(1, SCHEDULER_EXCEPTION), GONE),
        Reason.FATAL_LOG,
        SCHEDULER_EXCEPTION,
    ),
    "load timeout while warming": (
        _unasked(Drive.warming, TimerFired(TimerName.LOAD, 1), GONE),
        Reason.LOAD_TIMEOUT,
        "no decode within 1800s",
    ),
    "readiness probe failed": (
        _unasked(Drive.warming, ProbeDone(1, ProbeKind.READINESS, failed_result()), GONE),
        Reason.READINESS_FAILED,
        failed_result().error or failed_result().reason,
    ),
    "liveness failed threshold times": (
        _unasked(Drive.ready, *[ProbeDone(1, ProbeKind.LIVENESS, failed_result())] * 3, GONE),
        Reason.LIVENESS_FAILED,
        "(3/3)",
    ),
    "gone without an exit event": (
        _unasked(Drive.degraded, ChildGone(1, 1, None)),
        Reason.EXITED,
        "exit code 1",
    ),
    "exec failed": (
        _unasked(Drive.launching, LaunchFailed(1, "cannot start /opt/sglang/venv/bin/python")),
        Reason.EXITED,
        "cannot start /opt/sglang/venv/bin/python",
    ),
}


@pytest.mark.parametrize("case", list(UNASKED))
def test_exit_mode_records_stops_and_cleans_instead_of_backing_off(case: str) -> None:
    run, reason, detail = UNASKED[case]
    d, actions = run()
    record = of(RecordRestart, actions)
    assert len(record) == 1 and record[0].reason is reason and detail in record[0].detail
    after = actions[actions.index(record[0]) + 1 :]
    assert after == [
        Transitioned(
            State.RESTARTING, State.STOPPING, "restart_mode_exit", f"{reason}: {record[0].detail}"
        ),
        *ALL_TIMERS,
        CleanHost(),
    ]
    assert not backoff_delays(actions)
    assert (d.state, d.m.ctx.child, d.m.ctx.launch) == (State.STOPPING, False, 1)


@pytest.mark.parametrize("case", list(UNASKED))
def test_exit_mode_exits_75_once_the_host_is_clean(case: str) -> None:
    d, _ = UNASKED[case][0]()
    assert d.send(HostReady(), after=2) == [
        Transitioned(
            State.STOPPING,
            State.STOPPED,
            "restart_mode_exit",
            "exit 75: the orchestrator relaunches the group",
        ),
        Exit(75),
    ]
    assert d.state is State.STOPPED


def test_exit_mode_exit_status_is_neither_success_nor_config_nor_internal_error() -> None:
    # 0 would not restart a Kubernetes container with restartPolicy OnFailure; 78 is EX_CONFIG
    # (systemd's RestartPreventExitStatus=); 1 is what an internal error exits with.
    assert EX_RESTART_BY_ORCHESTRATOR == 75
    assert EX_RESTART_BY_ORCHESTRATOR not in (0, 1, 78)


def test_exit_mode_exits_even_when_the_host_cannot_be_cleaned() -> None:
    d, _ = UNASKED["exit while ready"][0]()
    actions = d.send(HostNotReady("GPU memory still held on GPU 3"), after=60)
    assert actions == [
        Transitioned(
            State.STOPPING,
            State.STOPPED,
            "restart_mode_exit",
            "host not clean: GPU memory still held on GPU 3; exit 75",
        ),
        Exit(75),
    ]


def test_exit_mode_sigterm_while_cleaning_waits_for_the_cleaning() -> None:
    d, _ = UNASKED["exit while ready"][0]()
    assert d.send(StopRequested()) == []
    assert d.send(StopRequested("SIGINT")) == []  # nothing to kill: SGLang is already gone
    assert of(Exit, d.send(HostReady())) == [Exit(75)]


def test_exit_mode_ignores_stale_events_while_handing_over() -> None:
    d, _ = UNASKED["exit while ready"][0]()
    for event in events(
        TimerFired(TimerName.BACKOFF, 1),
        TimerFired(TimerName.LOAD, 1),
        ChildExited(1, None, 9),
        ChildGone(1, None, 9),
        PortOpen(1),
        ProbeDone(1, ProbeKind.LIVENESS, ok_result()),
        RestartRequested(Reason.MANUAL),
    ):
        assert d.send(event) == [], event
    assert d.state is State.STOPPING and d.m.ctx.handing_over


def test_exit_mode_a_second_cleaning_result_does_nothing() -> None:
    d, _ = UNASKED["exit while ready"][0]()
    d.send(HostReady())
    assert d.send(HostReady()) == []
    assert d.send(HostNotReady("late")) == []
    assert d.state is State.STOPPED


@pytest.mark.parametrize("reason", [Reason.MANUAL, Reason.RELOAD])
def test_exit_mode_still_relaunches_in_place_when_asked(reason: Reason) -> None:
    # An operator's restart or a reload is not a failure of the group's launch on this node
    # alone; it drains and relaunches here as in relaunch mode.
    d = Drive(EXIT_CFG).ready()
    assert d.send(RestartRequested(reason))[-1] == StopChild(1, graceful=True)
    actions = d.send(ChildGone(1, 0, None), after=3)
    assert transitions(actions) == [(State.RESTARTING, State.CLEANING)]
    assert actions[-1] == CleanHost() and not d.m.ctx.handing_over


def test_exit_mode_a_process_stuck_in_the_driver_still_fails() -> None:
    # Exiting cannot free a GPU held by a process in D state; the pod would not terminate
    # either. `failed` says so and stays (the same as relaunch mode).
    d = Drive(EXIT_CFG).restarting()
    actions = d.send(ChildGone(1, None, 9, stuck=(77,)))
    assert transitions(actions) == [(State.RESTARTING, State.FAILED)]
    assert not of(Exit, actions)


def test_exit_mode_a_stop_requested_before_anything_failed_exits_0() -> None:
    d = Drive(EXIT_CFG).ready()
    d.send(StopRequested())
    assert of(Exit, d.send(ChildGone(1, 0, None), after=3)) == [Exit(0)]


def test_relaunch_mode_is_the_default_and_backs_off() -> None:
    assert CFG.restart.mode == "relaunch"
    d = Drive().ready()
    actions = d.crash()
    assert backoff_delays(actions) == [5.0] and not of(CleanHost, actions)
    assert d.state is State.RESTARTING and not d.m.ctx.handing_over


@pytest.mark.parametrize(("stop_s", "left"), [(0.0, 5.0), (3.0, 2.0), (7.5, 0.0)])
def test_stopping_the_old_launch_overlaps_the_backoff(stop_s: float, left: float) -> None:
    """The backoff is counted from the restart decision: the seconds SGLang's processes take
    to go are not added to the downtime, and the next launch still comes no sooner than the
    backoff after the decision."""
    d = Drive().ready()
    for _ in range(CFG.liveness.failure_threshold):
        d.liveness(failed_result())
    assert d.state is State.RESTARTING
    timers = [a for a in d.send(ChildGone(1, None, 9), after=stop_s) if isinstance(a, SetTimer)]
    assert timers == [SetTimer(TimerName.BACKOFF, pytest.approx(left), 1)]
