"""What the daemon keeps about the current launch for its incident, and when it writes it.

The daemon's hooks, in the order a launch meets them (each one line in the daemon):

    recorder.launched(launch, profile, cfg)                 # after spawn (Launch action)
    recorder.line(line, clock())                            # every SGLang line (log pump)
    recorder.port_open(clock())                             # PortOpen
    recorder.server_info(doc)                               # each /server_info read
    recorder.probe_ok(clock(), latency_s)                   # first successful readiness probe
    await recorder.before_kill(reason, pids, clock())       # before StopChild(graceful=False)
    recorder.record(reason, detail, exit_code, signal, tail, gpus)   # at RecordRestart

Nothing here raises into the daemon: a broken disk or a failing py-spy is reported in the
return value and the log, and supervision goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor import redact
from supervisor.config import Config
from supervisor.core.states import DIED_REASONS
from supervisor.incidents import Incident, IncidentStore, Written, digest_file, stacks
from supervisor.sglang.loadphases import LoadTimeline

# Restarts somebody asked for leave no incident (contract: "every restart nobody asked for").
REQUESTED = frozenset({"manual", "reload"})
# Reasons for which SGLang's processes are alive when the restart is decided: worth a dump.
# A GPU fault (an Xid while serving) leaves the processes alive, stuck where the GPU failed them.
ALIVE_REASONS = frozenset(
    {"liveness_failed", "load_timeout", "fatal_log", "readiness_failed", "gpu_fault"}
)


@dataclass
class _Launch:
    launch: int
    profile: str
    config_path: str
    config_digest: str | None
    crash_dump_folder: str | None
    launched_at_unix: float
    timeline: LoadTimeline
    ready_at_unix: float | None = None
    port_open_at_unix: float | None = None
    server_info: dict[str, Any] | None = None
    capture: stacks.Capture | None = None
    no_stacks_reason: str | None = None
    stop_started_unix: float | None = None
    # `caches` and `prewarm` of /status.last_load: the round before this launch (warm/).
    extras: Callable[[], dict[str, Any]] | None = None

    def load_document(self) -> dict[str, Any]:
        return {**self.timeline.document(), **(self.extras() if self.extras else {})}


def _crash_dump_folder(cfg: Config, profile: str) -> str | None:
    args = {**cfg.sglang.args, **cfg.profile(profile).args}
    value = args.get("crash-dump-folder")
    return value if isinstance(value, str) and value else None


class IncidentRecorder:
    def __init__(
        self,
        cfg: Config,
        *,
        capture: Callable[..., Any] = stacks.capture,
        wall: Callable[[], float] = time.time,
        load_extras: Callable[[], Callable[[], dict[str, Any]] | None] = lambda: None,
    ) -> None:
        self.cfg = cfg
        self._capture = capture
        self._wall = wall
        self.store = IncidentStore(cfg.incidents, clock=wall)
        self._cur: _Launch | None = None
        self.last_load: dict[str, Any] | None = None
        self.last_incident: Path | None = None
        # The report of what was prepared for the launch being made (Warm.current).
        self.load_extras = load_extras

    def reconfigure(self, cfg: Config) -> None:
        """After a reload: the next incidents follow the new incidents section."""
        self.cfg = cfg
        self.store = IncidentStore(cfg.incidents, clock=self._wall)

    # ------------------------------------------------------------ the launch

    def launched(self, launch: int, profile: str, mono_now: float) -> None:
        self._cur = _Launch(
            launch=launch,
            profile=profile,
            config_path=self.cfg.path,
            config_digest=digest_file(self.cfg.path),
            crash_dump_folder=_crash_dump_folder(self.cfg, profile),
            launched_at_unix=self._wall(),
            timeline=LoadTimeline(mono_now),
            extras=self.load_extras(),
        )

    def loading(self) -> dict[str, Any] | None:
        """The launch being loaded, for /status.loading: its number, the phase it is in and
        the phases it finished (None once it is ready, or before any launch)."""
        cur = self._cur
        if cur is None or cur.ready_at_unix is not None:
            return None
        return {
            "launch": cur.launch,
            "phase": cur.timeline.current(),
            "phases": cur.timeline.phases(),
        }

    def line(self, line: str, mono_now: float) -> None:
        if self._cur is not None:
            self._cur.timeline.feed(line, mono_now)

    def port_open(self, mono_now: float) -> None:
        if self._cur is not None:
            self._cur.timeline.port_open(mono_now)
            self._cur.port_open_at_unix = self._wall()

    def server_info(self, doc: dict[str, Any]) -> None:
        if self._cur is not None:
            # Kept for the incident: SGLang's answer names its API key (api_key, launch_command,
            # internal_states), and incident directories are made to be shared.
            self._cur.server_info = redact.document(doc)
            # A release that reports its startup timings there (0.5.23: `startup_time`) fills
            # in what its log line did not give.
            if self._cur.timeline.server_info(doc) and self._cur.ready_at_unix is not None:
                self.last_load = self._cur.load_document()

    def probe_ok(self, mono_now: float, latency_s: float | None = None) -> dict[str, float]:
        """The load is complete: returns its phases (for kimi_serve_load_phase_seconds).
        `latency_s`: the passing probe's own span (`ProbeResult.latency_s`), which places its
        start, where `warmup` ends unless SGLang's ready line came first (loadphases.py)."""
        if self._cur is None:
            return {}
        if self._cur.ready_at_unix is None:
            self._cur.ready_at_unix = self._wall()
            self._cur.timeline.probe_ok(mono_now, latency_s)
            self.last_load = self._cur.load_document()
        return self._cur.timeline.phases()

    # ------------------------------------------------------------ the restart

    async def before_kill(self, reason: str, pids: Sequence[int]) -> stacks.Capture | None:
        """Stacks of the launch's live processes, within incidents.dump_timeout. Returns at
        the budget whatever py-spy does; the kill goes ahead after it."""
        cur = self._cur
        if cur is None:
            return None
        cur.stop_started_unix = self._wall()
        if reason not in ALIVE_REASONS:
            cur.no_stacks_reason = _ended(reason)
            return None
        try:
            cap: stacks.Capture = await self._capture(pids, self.cfg.incidents.dump_timeout)
        except Exception as exc:  # evidence is best effort; the kill is not
            cur.no_stacks_reason = f"{stacks.FAILED}: {exc!r}"
            return None
        cur.capture = cap
        return cap

    def record(
        self,
        reason: str,
        detail: str,
        exit_code: int | None,
        signal: int | None,
        log_tail: Sequence[str],
        gpus: Sequence[dict[str, Any]],
    ) -> Written | None:
        """Write the incident of this restart (None for one that was asked for)."""
        cur = self._cur
        if reason in REQUESTED or cur is None:
            return None
        if cur.capture is None and cur.no_stacks_reason is None:
            cur.no_stacks_reason = _ended(reason)
        timings: dict[str, Any] = {
            "launched_at": cur.launched_at_unix,
            "port_open_at": cur.port_open_at_unix,
            "ready_at": cur.ready_at_unix,
            "stop_started_at": cur.stop_started_unix,
            "stopped_at": self._wall(),
            "load_phases": cur.timeline.phases(),
            "stack_dump_s": round(cur.capture.seconds, 3) if cur.capture else None,
        }
        written = self.store.write(
            Incident(
                reason=reason,
                detail=detail,
                launch=cur.launch,
                profile=cur.profile,
                exit_code=exit_code,
                signal=signal,
                timings=timings,
                config_path=cur.config_path,
                config_digest=cur.config_digest,
                server_info=cur.server_info,
                gpus=gpus,
                log_tail=log_tail,
                capture=cur.capture,
                no_stacks_reason=None if cur.capture else cur.no_stacks_reason,
                crash_dump_folder=cur.crash_dump_folder,
            )
        )
        if written.path is not None:
            self.last_incident = written.path
        if self.last_load is None or not self.last_load.get("complete"):
            # A load that never finished (load_timeout): where it stopped is the news.
            self.last_load = cur.load_document()
        return written


def _ended(reason: str) -> str:
    """Why no stack was taken, as it was: SGLang died (`exited`), or kimi-serve stopped a
    SGLang that ran (a wrong answer, a collapse, a regressed trial: nothing hung to look at)."""
    if reason in DIED_REASONS:
        # The main process may still be alive after a worker's death (real SGLang's waits 5 s
        # before it dies): the launch had ended, which is why no stack was taken.
        return (
            f"{stacks.PROCESS_GONE}: the launch had ended ({reason}: SGLang or one of its "
            "workers died); stacks are taken of a live, hung or broken SGLang only"
        )
    return (
        f"not taken: kimi-serve stopped a running SGLang ({reason}); nothing hung or crashed, "
        "stacks are taken of a hung or broken SGLang only"
    )
