"""What the machine knows, and the core every part of it builds on. No I/O.

`Context` (all the machine's state), `MachineBase` (`_to()`, which checks every state change
against `EDGES`, and the launch helpers), the constants the rules share (`_REQUESTED`,
`PROBE_RETRY_DELAY`, `ILLEGAL`), `_how` and `IllegalTransition`. The lowest layer of the
machine: machine.py and its rule modules import it, it imports none of them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from supervisor.config import PRIMARY, Config
from supervisor.core.events import Action, CancelTimer, Transitioned
from supervisor.core.states import EDGES, Reason, State, TimerName, TrialVerdict, UpgradeState

# Restarts an operator asked for: SGLang drains (SIGTERM, stop.drain_timeout), and they neither
# back off nor count towards a crash loop. Every other reason means the server is already
# broken, so it is killed at once: SGLang's SIGTERM drain waits for in-flight requests with no
# time limit (docs/sglang.md, "Shutdown").
_REQUESTED = frozenset({Reason.MANUAL, Reason.RELOAD})
PROBE_RETRY_DELAY = 0.25
# Readiness probes whose canary may get no answer before the launch is restarted
# (canary_unavailable): a bounded number, not the whole load budget.
CANARY_TRIES = 3
ILLEGAL = "illegal transition"


def _how(exit_code: int | None, sig: int | None) -> str:
    return f"killed by signal {sig}" if sig else f"exit code {exit_code}"


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Context:
    """All the machine knows. One object, so no decision hides in a flag elsewhere."""

    state: State = State.STARTING
    since: float = 0.0
    profile: str = PRIMARY
    launch: int = 0
    child: bool = False  # a process of `launch` may exist (from Launch until ChildGone)
    launched_at: float | None = None
    ready_at: float | None = None
    probe_in_flight: bool = False
    liveness_failures: int = 0
    restarts: deque[float] = field(default_factory=deque)  # times, on the current profile
    backoff: float = 0.0
    pending: Reason | None = None  # why the current child is being stopped
    pending_detail: str = ""
    host_message: str = ""  # why cleaning cannot finish, for STATUS
    host_retries: int = 0
    ever_ready: bool = False  # READY=1 has been sent once: systemd's start job is over
    canary_at: float | None = None  # when the launch's last canary was asked for
    canary_tries: int = 0  # readiness canaries of this launch that got no answer
    # restart.mode: exit — stopping to let the orchestrator relaunch: exit once the host is clean.
    handing_over: bool = False
    # An effect of the daemon failed: it stops cleanly, and exits 1 whatever the stop's own code.
    internal_error: bool = False
    # The last known good and the trial (core/upgrade_rules.py).
    upgrade: UpgradeState = UpgradeState.NONE
    upgrade_why: str = ""
    # The profiles with a last known good, and its gate readings (tokens/s, accept length).
    lkgs: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    compared: bool = False  # LaunchCompared of the current launch came (or it has no LKG)
    has_lkg: bool = False  # the launch's profile has a last known good
    trial: bool = False  # the launch (the config's, on its profile) differs from it
    lkg_tps: float | None = None  # the last known good's gate readings
    lkg_accept: float | None = None
    rollback_refusal: str | None = None  # why the last known good cannot be relaunched
    on_lkg: bool = False  # launches run the last known good's command (until reload, accept)
    # The profile a rollback in force was made on: its launches run its last known good. The
    # fallback profile is launched from the config (on_lkg False); back on this profile (a
    # restart), the last known good again, never the trial.
    rolled_back: str | None = None
    holding: bool = False  # the child being stopped is a held trial: `failed` once it is gone
    accept_next: bool = False  # an operator accepted: the next launch is taken as it is
    awaiting_lkg: bool = False  # passed its gate: promoted once it served trial_period
    regressed: bool = False  # this launch regressed (on_trial_regression alert): never promoted
    # The trial's verdict at its gate (/status.upgrade.trial.verdict): pass, regressed or
    # inconclusive (its speed read while SGLang was busy); None before the gate.
    verdict: TrialVerdict | None = None
    gate_tps: float | None = None  # the launch's gate readings, recorded if it is promoted
    gate_accept: float | None = None


class MachineBase:
    """The machine's config and context, and the helpers every rule of it uses."""

    def __init__(self, cfg: Config, now: float) -> None:
        self.cfg = cfg
        self.ctx = Context(since=now, backoff=cfg.restart.backoff_initial)

    def reconfigure(self, cfg: Config) -> None:
        """A reload took `cfg`: the next decisions follow it."""
        self.cfg = cfg

    # ------------------------------------------------------------------ helpers

    @property
    def state(self) -> State:
        return self.ctx.state

    def _to(self, new: State, reason: str, now: float, detail: str = "") -> list[Action]:
        old = self.ctx.state
        if new not in EDGES[old]:
            raise IllegalTransition(f"{ILLEGAL}: {old} -> {new} ({reason})")
        self.ctx.state = new
        self.ctx.since = now
        return [Transitioned(old, new, reason, detail)]

    def _cancel_launch_timers(self) -> list[Action]:
        names = (TimerName.LOAD, TimerName.LIVENESS, TimerName.PROBE_RETRY)
        return [CancelTimer(n) for n in names]

    def _current(self, launch: int) -> bool:
        return launch == self.ctx.launch
