"""What the daemon reports: the /status document, the STATUS= line and the metrics.

Fed by the machine's actions (`Transitioned`, `RecordRestart`, ...) and by the effects' results
(a probe's verdict, a cleaning report, the intent check), never read back for a decision: the
machine's `Context` is the only state that decides anything. Restarts are counted once, in the
Prometheus counter; /status reads them from there.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

from supervisor import __version__, gpu, log
from supervisor.config import Config
from supervisor.core.downtime import REQUESTED, Downtime
from supervisor.core.machine import (
    MODEL_MISSING,
    Context,
    ProbeKind,
    RecordRestart,
    State,
    Transitioned,
    UpgradeState,
)
from supervisor.daemon.links import RouterSlot
from supervisor.gpu import CleanReport, SweepReport, nvml
from supervisor.gpu.nvml import Nvml
from supervisor.metrics import Metrics
from supervisor.process import Child
from supervisor.router import RouterLink, unlinked_status
from supervisor.sglang import intent
from supervisor.sglang.probe import ProbeResult

# A version is a short label value from a peer: anything else is not taken.
VERSION_TEXT = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")

if TYPE_CHECKING:
    from supervisor.daemon.group import Group
    from supervisor.daemon.quality_watch import QualityWatch
    from supervisor.gpu.fitness_watch import Monitor
    from supervisor.incidents import Written
    from supervisor.incidents.recorder import IncidentRecorder

EVENTS_KEPT = 50
GPU_CACHE_S = 2.0


@dataclass
class Gpus:
    """What the daemon's start opens for managed GPUs (gpus.manage): NVML (startup.prepare)
    and the fitness watch (fitness_watch.start). None until then, and without gpus.manage."""

    nvml: Nvml | None = None
    monitor: Monitor | None = None


class Observed:
    def __init__(
        self,
        cfg: Config,
        ctx: Context,
        metrics: Metrics,
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
        *,
        gpus: Gpus | None = None,
        links: RouterSlot | None = None,
        recorder: IncidentRecorder | None = None,
        quality: QualityWatch | None = None,
        group: Group | None = None,
        note: Callable[[], str] = str,
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx  # read only: for the state, profile and launch times it shows
        self.metrics = metrics
        self.clock = clock
        self.wall = wall
        self.log = log.get()
        self.gpus = gpus or Gpus()
        # /status.leftovers: every leftover removed before the last launch, summed over the
        # cleanings before it (a held port or busy GPU retries the cleaning, and a retry that
        # finds nothing more must not hide what the first one killed).
        self.leftovers: dict[str, Any] = gpu.leftover_status(None, None)
        self._launched_since_cleaning = True
        self.child: Child | None = None
        self.sglang_version = "unknown"
        me = psutil.Process()
        self.own_process = {"pid": me.pid, "create_time": me.create_time()}
        self.since_unix = wall()
        self.detail = ""
        self.reason = ""  # the last transition's reason: a code, never SGLang's text
        self.last_restart: dict[str, Any] | None = None
        self.last_probe: dict[str, Any] | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self.host: dict[str, Any] = {}
        self.intent: dict[str, Any] = {"checked": False, "mismatches": []}
        self.links = links or RouterSlot()  # the router link, when router.url is set
        self.group = group  # the coordination of a multi-node replica
        self.reload_refused: str | None = None  # why the last valid reload was not taken
        self.quality = quality  # serving quality (None in tests that build Observed alone)
        self._gpus_cache: tuple[float, list[dict[str, Any]]] = (0.0, [])
        # Read for /status.last_load (None in tests that build Observed alone).
        self.recorder = recorder
        self.downtime = Downtime()
        # A line STATUS= ends with while it says something (the prewarm's progress: warm/).
        self.note = note
        metrics.set_gpu_source(self.gpu_status)

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg

    @property
    def router(self) -> RouterLink | None:
        return self.links.current

    @property
    def nvml(self) -> Nvml | None:
        return self.gpus.nvml

    @property
    def monitor(self) -> Monitor | None:
        return self.gpus.monitor

    def refused_reload(self, why: str | None) -> None:
        self.reload_refused = why

    # ------------------------------------------------------------------ fed by actions

    def transitioned(self, t: Transitioned) -> None:
        now_unix = self.wall()
        self.detail = t.detail
        self.reason = t.reason
        if t.old is not t.new:
            self.since_unix = now_unix
            self.metrics.set_state(t.new, now_unix)
        launched_at = self.ctx.launched_at
        if t.new is State.READY and t.old is State.WARMING and launched_at is not None:
            self.metrics.last_load.set(self.clock() - launched_at)
        down = self.downtime.transitioned(t, self.clock())
        if down is not None:
            self.metrics.restart_downtime.observe(down)
            if self.last_restart is not None:
                self.last_restart["downtime_s"] = round(down, 3)
        self._remember(t, now_unix)
        level = {State.RESTARTING: "warning", State.WAITING: "warning", State.FAILED: "error"}.get(
            t.new, "info"
        )
        getattr(self.log, level)(
            "state",
            old=t.old.value,
            new=t.new.value,
            reason=t.reason,
            detail=t.detail,
            profile=self.ctx.profile,
        )

    def _remember(self, t: Transitioned, now_unix: float) -> None:
        """The history of /status.events. A state that re-enters itself for the same reason
        again and again (cleaning -> cleaning while another process holds SGLang's port, every
        retry) is one entry counting the repeats, so the history keeps the real changes."""
        last = self.events[-1] if self.events else None
        if (
            t.old is t.new
            and last is not None
            and (last["from"], last["to"], last["reason"]) == (t.old.value, t.new.value, t.reason)
        ):
            last["count"] += 1
            last["last_at"] = now_unix
            last["detail"] = t.detail  # the newest: what is in the way now
            return
        self.events.append(
            {
                "at": now_unix,
                "from": t.old.value,
                "to": t.new.value,
                "reason": t.reason,
                "detail": t.detail,
                "count": 1,  # how many times in a row (the last at `last_at`)
                "last_at": now_unix,
            }
        )

    def restart(self, action: RecordRestart, tail: list[str]) -> None:
        self.metrics.restarts.labels(action.reason.value).inc()
        self.last_restart = {
            "reason": action.reason.value,
            "at": self.wall(),
            "exit_code": action.exit_code,
            "signal": action.signal,
            "detail": action.detail,
            "profile": self.ctx.profile,
            "log_tail": tail,
            "downtime_s": None,  # set once ready again (unrequested restarts only)
        }
        if action.reason in REQUESTED:
            # Asked for (manual, reload): not a failure, so not at error level, and without
            # SGLang's last lines (`journalctl -p err` lists failures only; /status keeps them).
            self.log.info("sglang restart", reason=action.reason.value, detail=action.detail)
            return
        self.log.error(
            "sglang restart",
            reason=action.reason.value,
            detail=action.detail,
            exit_code=action.exit_code,
            signal=action.signal,
            log_tail=tail[-30:],
        )

    def incident_written(self, written: Written | None) -> None:
        """The incident of the restart just recorded: /status.last_restart.incident."""
        if written is None:  # a restart somebody asked for
            return
        if self.last_restart is not None:
            self.last_restart["incident"] = None if written.path is None else str(written.path)
        if written.error:
            self.log.error("cannot write the incident", error=written.error)
        elif written.skipped:
            path = str(written.path)
            self.log.warning("incident written without", path=path, skipped=written.skipped)
        else:
            self.log.info("incident written", path=str(written.path))

    def profile(self, old: str | None, new: str) -> None:
        if old is not None:
            self.log.warning("profile changed", old=old, new=new)
        self.metrics.set_profile(new, self.cfg.profile_names)

    # ------------------------------------------------------------------ fed by effects

    def probe(self, kind: ProbeKind, result: ProbeResult, busy: bool) -> None:
        outcome = "ok" if result.ok else "failed"
        self.metrics.probe_duration.labels(kind.value, outcome).observe(result.latency_s)
        if not result.ok:
            self.metrics.probe_failures.labels(kind.value, result.reason).inc()
        self.last_probe = {
            "kind": kind.value,
            "ok": result.ok,
            "latency_s": round(result.latency_s, 4),
            "completion_tokens": result.completion_tokens,
            "error": result.error,
            "reason": result.reason,
            "spec_verify_ct": result.spec_verify_ct,
            "busy": busy,
            "at": self.wall(),
        }
        if not result.ok:
            self.log.warning(
                "probe failed", kind=kind.value, reason=result.reason, error=result.error, busy=busy
            )
        else:
            self.log.debug("probe ok", kind=kind.value, latency_s=result.latency_s)

    def swept(self, report: SweepReport) -> None:
        """The launch record's and owner marker's leftovers, killed before GPU cleaning: each
        counted with the GPU it held (gpu "none" when it held no GPU memory)."""
        if self._launched_since_cleaning:
            self.leftovers = gpu.leftover_status(None, None)
            self._launched_since_cleaning = False
        self._add_leftovers(gpu.leftover_status(report, None))
        self.metrics.count_leftovers(report.killed_rows())
        if report.processes or report.stuck:
            self.log.warning("leftovers of an earlier launch", message=report.message())

    def cleaned(self, report: CleanReport) -> None:
        self.host = report.to_dict()
        self._add_leftovers(gpu.leftover_status(None, report))
        self.metrics.count_leftovers(report.killed_rows())
        if report.release_seconds is not None:
            self.metrics.gpu_release.set(report.release_seconds)
        self._gpus_cache = (0.0, [])

    def intent_checked(
        self, info: dict[str, Any] | None, mismatches: list[intent.Mismatch]
    ) -> None:
        if info is None:
            self.intent = {"checked": False, "mismatches": [], "error": "server_info unavailable"}
            return
        # The running server's own version (http_server.py:888 in 0.5.23, docs/sglang.md) wins
        # over the one preflight read from the interpreter: the stand-in, an upgrade since.
        version = info.get("version")
        if isinstance(version, str) and VERSION_TEXT.fullmatch(version):
            self.sglang(version)
        self.metrics.mismatch.clear()
        for m in mismatches:
            self.metrics.mismatch.labels(m.arg).set(1)
            self.log.warning(
                "server differs from the configuration",
                arg=m.arg,
                expected=m.expected,
                actual=m.actual,
            )
        self.intent = {
            "checked": True,
            "version": info.get("version"),
            "mismatches": [
                {"arg": m.arg, "expected": m.expected, "actual": m.actual} for m in mismatches
            ],
        }

    def _add_leftovers(self, part: dict[str, Any]) -> None:
        killed = self.leftovers["killed"]
        for g, n in part["killed"].items():
            killed[g] = killed.get(g, 0) + n
        self.leftovers["processes"] += part["processes"]

    def launched(self, child: Child) -> None:
        self.child = child
        self._launched_since_cleaning = True
        self.metrics.child_starts.inc()
        self.metrics.child_start_time.set(child.started_at)

    def carried(self) -> dict[str, Any]:
        """What /status shows of the state that a hand-over passes on (daemon/handover.py)."""
        return {
            "since": self.since_unix,
            "detail": self.detail,
            "reason": self.reason,
            "last_restart": self.last_restart,
            "events": list(self.events),
        }

    def adopted(self, child: Child, carried: object) -> None:
        """A launch a hand-over passed on, shown as it was: the state since it was entered
        (not since the exec), its gauges (`kimi_serve_ready` 1 again at once, never a start
        counted), the last restart and the timeline."""
        got = carried if isinstance(carried, dict) else {}
        self.child = child
        since = got.get("since")
        if isinstance(since, int | float) and not isinstance(since, bool):
            self.since_unix = float(since)
        self.detail, self.reason = str(got.get("detail") or ""), str(got.get("reason") or "")
        last = got.get("last_restart")
        self.last_restart = last if isinstance(last, dict) else None
        self.events.extend(e for e in got.get("events") or [] if isinstance(e, dict))
        self.metrics.set_state(self.ctx.state, self.since_unix)
        self.metrics.child_start_time.set(child.started_at)

    def stopped(self) -> None:
        # /status keeps showing the child while it is alive (a process stuck after SIGKILL).
        self.metrics.child_start_time.set(0)

    def sglang(self, version: str) -> None:
        self.sglang_version = version
        self.metrics.set_sglang_version(version)

    def gpus_known(self) -> None:
        # Series per managed GPU exist from the first scrape, so increase() sees the first kill.
        for g in self.gpu_status():
            self.metrics.gpu_killed.labels(str(g["index"]), str(g["uuid"]))

    # ------------------------------------------------------------------ read by admin

    def status_line(self, public: bool = False) -> str:
        """One line of state. `public`: for systemd's STATUS=, which any local user reads with
        `systemctl status`: the transition's reason instead of its detail (a traceback, the
        canary's expected and received text: what /status withholds without the token)."""
        ctx = self.ctx
        state = ctx.state
        parts = [state.value, f"({ctx.profile}"]
        if state in (State.LAUNCHING, State.LOADING, State.WARMING) and ctx.launched_at:
            parts[-1] += f", {self.clock() - ctx.launched_at:.0f} s"
        parts[-1] += ")"
        if state is State.LOADING:
            parts.append(f"- waiting for port {self.cfg.sglang.port}")
        elif state is State.WARMING:
            parts.append("- decode probe")
        elif state is State.WAITING:
            parts.append(f"- {MODEL_MISSING}, checked again with backoff")
        elif state in (State.READY, State.DEGRADED) and self.last_probe:
            parts.append(f"- probe {self.last_probe['latency_s'] * 1000:.0f} ms")
            if state is State.DEGRADED:
                parts.append(
                    f"failing {ctx.liveness_failures}/{self.cfg.liveness.failure_threshold}"
                )
        degraded = [] if self.quality is None else self.quality.degraded()
        if degraded and state in (State.READY, State.DEGRADED, State.DRAINING):
            parts.append(f"- quality: {', '.join(degraded)}")
        if self.detail and state in (State.RESTARTING, State.FAILED, State.CLEANING, State.WAITING):
            parts.append(
                f"- {self.reason} (detail: kimi-serve status)" if public else f"- {self.detail}"
            )
        if ctx.on_lkg:
            parts.append("- ROLLED BACK: serving the last known good, not the config")
        elif ctx.upgrade is UpgradeState.HELD:
            parts.append("- HELD: a regressed trial (kimi-serve upgrade status)")
        elif ctx.upgrade is UpgradeState.REGRESSED:
            parts.append("- REGRESSED: a regressed trial serves (kimi-serve upgrade status)")
        elif ctx.trial:
            parts.append("- trial")
        if note := self.note():
            parts.append(f"- {note}")
        return " ".join(parts)[:400]

    def loading(self) -> dict[str, Any] | None:
        """/status.loading while a launch loads (launching, loading, warming): its launch
        number, phase (SGLang's load markers), seconds since the launch and the load_timeout
        they count against; None otherwise. `kimi-serve status` and `restart --wait` show it."""
        ctx = self.ctx
        if ctx.state not in (State.LAUNCHING, State.LOADING, State.WARMING):
            return None
        doc: dict[str, Any] = {"launch": ctx.launch, "phase": "init", "phases": {}}
        current = None if self.recorder is None else self.recorder.loading()
        if current is not None and current["launch"] == ctx.launch:
            doc = current
        elapsed = None if ctx.launched_at is None else round(self.clock() - ctx.launched_at, 1)
        return {**doc, "elapsed_s": elapsed, "load_timeout_s": self.cfg.readiness.load_timeout}

    def gpu_status(self) -> list[dict[str, Any]]:
        if self.nvml is None:
            return []
        at, cached = self._gpus_cache
        if self.clock() - at < GPU_CACHE_S and cached:
            return cached
        try:
            snaps = nvml.select(self.nvml.snapshot(), self.cfg.gpus.devices)
            cached = nvml.gpu_status(snaps)
        except Exception as exc:  # a lost GPU must not break /status or /metrics
            self.log.warning("gpu snapshot failed", error=str(exc))
            cached = []
        if self.monitor is not None:
            # The last fitness verdict (before the launch, or after a critical event) wins over
            # the snapshot's: it carries the last Xid.
            health = self.monitor.health_by_index()
            cached = [
                {**g, "health": health[g["index"]]} if g["index"] in health else g for g in cached
            ]
        self._gpus_cache = (self.clock(), cached)
        return cached

    def status_document(self) -> dict[str, Any]:
        ctx = self.ctx
        child = self.child if self.child is not None and self.child.alive() else None
        return {
            "state": ctx.state.value,
            "since": self.since_unix,
            "detail": self.detail,
            "status_line": self.status_line(),
            "profile": ctx.profile,
            "version": __version__,
            "sglang_version": self.sglang_version,
            "config": self.cfg.path,
            # Whom `kimi-serve preflight` matches the SGLang port's holder against (its
            # ancestry): this process, by PID and start time (preflight/serving.py).
            "daemon_process": self.own_process,
            "child": None
            if child is None
            else {
                "pid": child.pid,
                "started_at": child.started_at,
                "launch": child.launch,
                "processes": sorted(i.pid for i in child.known),
            },
            "launch": ctx.launch,
            "loading": self.loading(),
            "restarts": self.metrics.restart_counts(),
            "last_restart": self.last_restart,
            "last_probe": self.last_probe,
            "last_load": None if self.recorder is None else self.recorder.last_load,
            "liveness_failures": ctx.liveness_failures,
            "gpus": self.gpu_status(),
            "host": self.host,
            "leftovers": self.leftovers,
            "intent": self.intent,
            "events": list(self.events),
            "router": unlinked_status() if self.router is None else self.router.status(),
            "reload_refused": self.reload_refused,
            **({} if self.quality is None else {"quality": self.quality.status()}),
            **({} if self.group is None else {"group": self.group.status()}),
        }
