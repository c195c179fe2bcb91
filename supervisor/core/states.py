"""The machine's states, the edges between them and the small enums its events and actions use.

The lowest layer of the state machine (`machine`): no I/O, no imports from the supervisor.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    STARTING = "starting"
    CLEANING = "cleaning"
    # The model or draft model directory is missing (a mount not up yet): checked again with
    # the cleaning's backoff, never counted towards the crash loop (reason `model_missing`).
    WAITING = "waiting"
    LAUNCHING = "launching"
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    DEGRADED = "degraded"
    # Decode-verified and running, but taken out of the router on request (POST /drain):
    # still liveness-probed, never registered, until /undrain, a restart or a stop.
    DRAINING = "draining"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Reason(StrEnum):
    EXITED = "exited"
    LOAD_TIMEOUT = "load_timeout"
    READINESS_FAILED = "readiness_failed"
    LIVENESS_FAILED = "liveness_failed"
    FATAL_LOG = "fatal_log"
    MANUAL = "manual"
    RELOAD = "reload"
    # A GPU was lost or the driver asked for a recovery action while SGLang ran.
    GPU_FAULT = "gpu_fault"
    # Another node of a multi-node replica ended the group's launch (docs/multinode.md).
    GROUP = "group"
    # quality.canary.policy gate: the launch's canary differs from the golden answer.
    CANARY_MISMATCH = "canary_mismatch"
    # quality.canary.policy gate: no canary answer (an error, a timeout) after CANARY_TRIES
    # readiness probes: no evidence the launch answers right, so it is not ready.
    CANARY_UNAVAILABLE = "canary_unavailable"
    # quality.on_spec_collapse fallback: speculation accepts (almost) nothing; relaunched on
    # restart.fallback_profile.
    SPEC_COLLAPSE = "spec_collapse"
    # A trial (a launch that differs from the last known good) regressed at its gate: a wrong
    # canary or known answer, slower decode or a lower accept length than the last known good's;
    # with quality.on_trial_regression rollback, the last known good is relaunched.
    TRIAL_REGRESSED = "trial_regressed"


class UpgradeState(StrEnum):
    """/status.upgrade.state: where the launch stands against the last known good."""

    NONE = "none"  # no trial: the launch is the last known good, or there is none yet
    TRIAL = "trial"  # the launch differs from the last known good
    ACCEPTED = "accepted"  # a trial became the last known good (trial_period, upgrade accept)
    ROLLED_BACK = "rolled_back"  # the last known good serves, not the config
    HELD = "held"  # a regressed trial, never ready (on_trial_regression hold)
    # A trial that regressed on speed or accept length serves all the same because no verifiable
    # last known good exists (on_trial_regression rollback, the rollback refused); never promoted.
    REGRESSED = "regressed"


class TrialVerdict(StrEnum):
    """/status.upgrade.trial.verdict: what the trial's gate found against the last known good."""

    PASS = "pass"  # its answers hold and it is no slower (or accepts no less) than allowed
    REGRESSED = "regressed"  # a wrong answer, slower decode or a lower accept length
    # Its speed was read while SGLang was busy: neither a pass nor a regression (its answers
    # held; a wrong answer is a regression whatever the load).
    INCONCLUSIVE = "inconclusive"


class Regression(StrEnum):
    """Why a trial was rolled back: kimi_serve_rollbacks_total{regression}."""

    CANARY = "canary"  # the canary disagrees with the golden (or the previous key's)
    KNOWN_ANSWERS = "known_answers"  # a known answer fails
    SPEED = "speed"  # decode tokens/s below trial_slowdown x the last known good's
    ACCEPT_LENGTH = "accept_length"  # accept length below trial_accept_drop x the LKG's
    CRASH_LOOP = "crash_loop"  # the trial crash-looped
    MANUAL = "manual"  # an operator asked (kimi-serve upgrade rollback)


SERVING = frozenset({State.READY, State.DEGRADED})
# States whose SGLang passed its decode probe and is liveness-probed.
PROBED = frozenset({*SERVING, State.DRAINING})
# States in which an SGLang process of the current launch may exist.
CHILD_STATES = frozenset({State.LAUNCHING, State.LOADING, State.WARMING, *PROBED})
# The states whose next step is a cleaning's answer (HostReady, HostNotReady, GpuUnfit).
HOST_CHECK = frozenset({State.CLEANING, State.WAITING})
# Still on the way to the first READY=1: systemd's start timeout is extended in these.
STARTUP_STATES = frozenset(
    {State.STARTING, State.CLEANING, State.WAITING, State.LAUNCHING, State.LOADING, State.WARMING}
)

# Every edge the daemon may take. STOPPING is reachable from everywhere (SIGTERM at any time).
EDGES: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.CLEANING}),
    # CLEANING -> FAILED: a wedged GPU (a process stuck in the driver) cannot be cleaned, or a
    # GPU is unfit (it needs a reset, a reboot or a replacement: fitness.py).
    State.CLEANING: frozenset({State.LAUNCHING, State.FAILED, State.WAITING}),
    # WAITING -> LAUNCHING once the cleaning that checks again finds the model; -> CLEANING
    # when what is in the way is something else; -> FAILED as from CLEANING.
    State.WAITING: frozenset({State.LAUNCHING, State.CLEANING, State.FAILED}),
    # LAUNCHING -> RESTARTING: the exec itself failed, or a fatal line / manual restart.
    State.LAUNCHING: frozenset({State.LOADING, State.RESTARTING}),
    State.LOADING: frozenset({State.WARMING, State.RESTARTING}),
    State.WARMING: frozenset({State.READY, State.RESTARTING}),
    State.READY: frozenset({State.DEGRADED, State.RESTARTING, State.DRAINING}),
    State.DEGRADED: frozenset({State.READY, State.RESTARTING, State.DRAINING}),
    # DRAINING -> READY / DEGRADED on /undrain (DEGRADED while liveness is still failing).
    State.DRAINING: frozenset({State.READY, State.DEGRADED, State.RESTARTING}),
    # RESTARTING -> CLEANING after the backoff; -> FAILED on a crash loop with no fallback left.
    State.RESTARTING: frozenset({State.CLEANING, State.FAILED}),
    # FAILED -> CLEANING only on reload or a manual restart.
    State.FAILED: frozenset({State.CLEANING}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.STOPPED: frozenset(),
}
for _s in State:
    if _s not in (State.STOPPING, State.STOPPED):
        EDGES[_s] = EDGES[_s] | {State.STOPPING}


class ProbeKind(StrEnum):
    READINESS = "readiness"
    LIVENESS = "liveness"


class TimerName(StrEnum):
    LOAD = "load_timeout"
    BACKOFF = "backoff"
    LIVENESS = "liveness"
    PROBE_RETRY = "probe_retry"
    CLEAN_RETRY = "clean_retry"


# The reasons for which SGLang ended by itself; every other restart is kimi-serve stopping a
# launch it judged (or one asked for): `status` and `incidents show` say which.
DIED_REASONS = frozenset({Reason.EXITED.value})
ASKED_REASONS = frozenset({Reason.MANUAL.value, Reason.RELOAD.value})


def how_it_ended(reason: object, how: list[str]) -> str:
    """How a launch ended, in parentheses after its reason: one kimi-serve stopped says so (its
    `signal 9` is kimi-serve's kill of a live server, not a crash); one that died says how."""
    if reason in DIED_REASONS:
        return f" (died: {', '.join(how)})" if how else ""
    if reason in ASKED_REASONS:
        return f" (stopped as asked: {', '.join(how)})" if how else ""
    return f" (stopped by kimi-serve: {reason}{''.join(', ' + h for h in how)})"
