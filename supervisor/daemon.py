"""The orchestrator: the one module that sees every other one.

The main loop reads in three lines: take an event, let the machine decide, carry out the
actions. Signal handlers, timers, the log pump, probes and process watchers only enqueue
events; nothing else changes state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import stat
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx

from supervisor import __version__, admin, command, gpu, intent, log, nvml, preflight
from supervisor import config as config_mod
from supervisor.config import Config, ConfigError, ConfigIssue
from supervisor.identity import LaunchRecord, RecordStore, owner_marker
from supervisor.logscan import LogScanner, Stream, guess_level
from supervisor.machine import (
    STARTUP_STATES,
    Action,
    CancelTimer,
    CheckIntent,
    ChildExited,
    ChildGone,
    CleanHost,
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
    PortOpen,
    ProbeDone,
    ProbeKind,
    ProfileChanged,
    ReadyLine,
    Reason,
    RecordRestart,
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
)
from supervisor.metrics import Metrics
from supervisor.notify import Notifier, watchdog_interval
from supervisor.probe import ProbeResult, is_busy, probe, read_progress, server_url
from supervisor.process import Child, ProcessOwner, wait_port_open
from supervisor.threads import in_thread

# A traceback is one log record over many lines; wait this long for its last line (the
# exception) before acting on its first, so the log tail keeps the line on-call needs.
FATAL_SETTLE_S = 1.0
# Systemd's start job is extended by this much each time, while loading a 10-minute model.
EXTEND_BY_S = 30.0
EXTEND_EVERY_S = 10.0
# Under a log flood, forward at most this many SGLang lines a second to our own log; every line
# is still counted, scanned for fatal patterns and kept in the tail.
FORWARD_PER_SECOND = 2000
FORWARD_BURST = 500
EVENTS_KEPT = 50
# Reading the config (and SGLang's parser verdict on it) at SIGHUP; host checks before a launch.
RELOAD_TIMEOUT_S = 120.0
# SGLang's parser gets 180 s of its own (a cold disk, a slow import); the rest is paths and GPUs.
PREFLIGHT_TIMEOUT_S = 240.0
HOST_CHECK_TIMEOUT_S = 30.0
# Leave this many file descriptors free before a launch (SGLang's pipes, pidfd, probes).
FD_HEADROOM = 64
LOOP_ERROR_EVERY_S = 60.0


@dataclass(frozen=True)
class _Reload:
    """SIGHUP: re-read the config file."""


@dataclass(frozen=True)
class _Reloaded:
    config: Config | ConfigError


@dataclass(frozen=True)
class _Settle:
    launch: int


Item = Event | _Reload | _Reloaded | _Settle


class Daemon:
    def __init__(
        self,
        cfg: Config,
        *,
        clock: Callable[[], float] = time.monotonic,
        notifier: Notifier | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.log = log.get()
        self.sglog = log.get("sglang")
        self.notifier = notifier or Notifier()
        self.metrics = metrics or Metrics(gpu_snapshot=self._gpu_status)
        self.machine = Machine(cfg, clock())
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.owner = ProcessOwner(owner_marker(cfg.state_dir), self._lines, self._exited)
        self.store = RecordStore(cfg.state_dir)
        self.scanner = LogScanner(cfg.logs.fatal_patterns, cfg.logs.tail_lines)
        self.child: Child | None = None
        self.spec = command.build(cfg)  # the current launch's command line
        self.nvml: Any = None
        self.sglang_version = "unknown"
        self._timers: dict[TimerName, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._launch_tasks: list[asyncio.Task[Any]] = []
        self._stopping: asyncio.Task[Any] | None = None
        self._stopped_launch = 0
        self._exit_code: int | None = None
        self._internal_error = False
        self._since_unix = time.time()
        self._ever_ready = False
        self._beat = clock()
        self._forward = (float(FORWARD_BURST), clock())
        self._suppressed = 0
        self._suppressed_since = 0.0
        self._gpus_cache: tuple[float, list[dict[str, Any]]] = (0.0, [])
        self._loop_errors: dict[str, float] = {}
        # What /status shows.
        self.restarts: Tally[str] = Tally()
        self.last_restart: dict[str, Any] | None = None
        self.last_probe: dict[str, Any] | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self.detail = ""
        self.host: dict[str, Any] = {}
        self.intent: dict[str, Any] = {"checked": False, "mismatches": []}
        self.http = httpx.AsyncClient(trust_env=False)

    # ============================================================ lifecycle

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.queue.put_nowait, StopRequested(sig.name))
        loop.add_signal_handler(signal.SIGHUP, self.queue.put_nowait, _Reload())
        # asyncio's default handler prints raw tracebacks (e.g. accept() failing with EMFILE).
        loop.set_exception_handler(self._loop_exception)
        raise_fd_limit()
        shutdown_admin: Callable[[], Any] | None = None
        try:
            # Started first: preflight runs SGLang's parser (seconds, up to minutes on a cold
            # disk) and systemd's start timeout must be extended meanwhile.
            self._spawn(self._ticker())
            code = await self._prepare()
            if code is not None:
                return code
            try:
                shutdown_admin = await admin.start(self, self.cfg.admin.host, self.cfg.admin.port)
            except OSError as exc:
                return self._fatal(
                    f"cannot serve the admin endpoint on {self.cfg.admin.listen}: "
                    f"{exc.strerror or exc} (admin.listen in {self.cfg.path})",
                    1,
                )
            self.log.info("admin endpoint", url=f"http://{self.cfg.admin.listen}/status")
            self.metrics.set_profile(self.machine.ctx.profile, self.cfg.profile_names)
            self.queue.put_nowait(Start())
            while self._exit_code is None:
                self._dispatch(await self.queue.get())
            return self._exit_code
        except Exception as exc:  # never leave SGLang behind, whatever went wrong here
            # One line for the operator; the traceback only at debug level, for a bug report.
            self.log.error("internal error; stopping SGLang", error=repr(exc))
            self.log.debug("internal error traceback", exc_info=True)
            return 1
        finally:
            await self._teardown(shutdown_admin)

    async def _prepare(self) -> int | None:
        """Checks that must pass before any GPU or process is touched. An exit code, or None."""
        try:
            self.store.check_writable()
        except OSError as exc:
            return self._fatal(
                f"state directory {self.cfg.state_dir} is not writable: "
                f"{exc.strerror or exc} (state_dir in {self.cfg.path}, or StateDirectory=)",
                1,
            )
        if self.cfg.gpus.manage:
            try:
                self.nvml = nvml.open_nvml()
            except nvml.NvmlUnavailable as exc:
                return self._fatal(
                    f"GPU management is on (gpus.manage) but NVML is unavailable: {exc}", 1
                )
        if self.nvml is not None:
            # Series per managed GPU exist from the first scrape, so increase() sees the first kill.
            for g in self._gpu_status():
                self.metrics.gpu_killed.labels(str(g["index"]), str(g["uuid"]))
        gpu_count = self._gpu_count if self.nvml is not None else None
        try:
            checks, code = await in_thread(
                lambda: preflight.startup_checks(self.cfg, gpu_count), PREFLIGHT_TIMEOUT_S
            )
        except TimeoutError:
            return self._fatal(f"preflight did not finish within {PREFLIGHT_TIMEOUT_S:g}s", 1)
        for check in preflight.failures(checks):
            self.log.error(
                "preflight",
                check=check.name,
                kind=check.kind,
                message=check.message,
                hint=check.hint,
            )
        if code is not None:
            # A flag SGLang rejects, a missing interpreter: no restart fixes it, so exit 78
            # (RestartPreventExitStatus=) instead of failing ten minutes into a load.
            return self._fatal(preflight.summary(checks), code)
        with contextlib.suppress(TimeoutError):
            version = await in_thread(lambda: preflight.sglang_version_for(self.cfg), 60.0)
            self.sglang_version = version or "unknown"
        self.metrics.set_sglang_version(self.sglang_version)
        return None

    def _gpu_count(self) -> int:
        return len(nvml.select(self.nvml.snapshot(), self.cfg.gpus.devices))

    def _loop_exception(self, _loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # One line, at most once a minute per message: asyncio's accept loop retries EMFILE
        # many times a second.
        message = str(context.get("message"))
        now = self.clock()
        if now - self._loop_errors.get(message, -LOOP_ERROR_EVERY_S) < LOOP_ERROR_EVERY_S:
            return
        self._loop_errors[message] = now
        self.log.warning("event loop", message=message, error=repr(context.get("exception")))

    def _fatal(self, message: str, code: int) -> int:
        self.log.error(message)
        self.notifier.status(f"failed to start: {message}")
        return code

    async def _teardown(self, shutdown_admin: Callable[[], Any] | None) -> None:
        # Whatever ended the loop, the current launch is stopped unless its stop completed
        # (killpg and the sweep are idempotent).
        if self.child is not None and self._stopped_launch != self.child.launch:
            with contextlib.suppress(Exception):
                await self.owner.stop(self.child, graceful=False, drain_timeout=0)
                self.store.clear()
        for handle in self._timers.values():
            handle.cancel()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if shutdown_admin is not None:
            with contextlib.suppress(Exception):
                await shutdown_admin()
        await self.http.aclose()
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            # A broken effect must not leave the machine waiting forever: stop cleanly.
            self._internal_error = True
            self.queue.put_nowait(StopRequested("internal-error"))
            self.log.error("internal task failed; stopping", error=repr(exc))
            self.log.debug("internal task traceback", exc_info=exc)

    # ============================================================ the loop

    def _dispatch(self, item: Item) -> None:
        self._beat = self.clock()
        if isinstance(item, _Reload):
            self._spawn(self._read_config())
            return
        if isinstance(item, _Reloaded):
            self._apply_config(item.config)
            return
        if isinstance(item, _Settle):
            if (
                self.scanner.settle()
                and self.child is not None
                and self.child.launch == item.launch
            ):
                self._dispatch(FatalLog(item.launch, self.scanner.evidence))
            return
        for action in self.machine.handle(item, self.clock()):
            self._do(action)

    def _do(self, action: Action) -> None:
        match action:
            case Transitioned():
                self._transitioned(action)
            case CleanHost():
                self._spawn(self._clean_host())
            case Launch():
                self._launch(action)
            case StartProbe():
                self._spawn(self._probe(action.launch, action.kind))
            case StopChild():
                self._stop_child(action)
            case SetTimer():
                self._set_timer(action)
            case CancelTimer():
                handle = self._timers.pop(action.name, None)
                if handle is not None:
                    handle.cancel()
            case NotifyReady():
                self._ever_ready = True
                self.notifier.ready(self.status_line())
            case RecordRestart():
                self._record_restart(action)
            case ProfileChanged():
                self.log.warning("profile changed", old=action.old, new=action.new)
                self.metrics.set_profile(action.new, self.cfg.profile_names)
            case CheckIntent():
                self._spawn(self._check_intent(action))
            case Exit():
                self._exit_code = 1 if self._internal_error else action.code

    def _set_timer(self, action: SetTimer) -> None:
        old = self._timers.pop(action.name, None)
        if old is not None:
            old.cancel()
        event = TimerFired(action.name, action.launch)
        self._timers[action.name] = asyncio.get_running_loop().call_later(
            action.delay, self.queue.put_nowait, event
        )

    def _transitioned(self, t: Transitioned) -> None:
        now_unix = time.time()
        self.detail = t.detail
        if t.old is not t.new:
            self._since_unix = now_unix
            self.metrics.set_state(t.new, now_unix)
        launched_at = self.machine.ctx.launched_at
        if t.new is State.READY and t.old is State.WARMING and launched_at is not None:
            self.metrics.last_load.set(self.clock() - launched_at)
        self.events.append(
            {
                "at": now_unix,
                "from": t.old.value,
                "to": t.new.value,
                "reason": t.reason,
                "detail": t.detail,
            }
        )
        level = {State.RESTARTING: "warning", State.FAILED: "error"}.get(t.new, "info")
        getattr(self.log, level)(
            "state",
            old=t.old.value,
            new=t.new.value,
            reason=t.reason,
            detail=t.detail,
            profile=self.machine.ctx.profile,
        )
        if t.new is State.STOPPING:
            self.notifier.stopping(self.status_line())
        else:
            self.notifier.status(self.status_line())
        if t.old is State.LOADING or t.new not in (State.LAUNCHING, State.LOADING):
            self._cancel_launch_watch(keep_tree=t.new not in (State.RESTARTING, State.STOPPING))

    # ============================================================ effects

    async def _clean_host(self) -> None:
        """Leftovers of earlier launches gone, GPU memory free, port free: or say why not."""
        try:
            await self._clean_host_once()
        except OSError as exc:
            # EMFILE, a vanished /proc entry, an unreadable state dir: the host's problem, and
            # one that can clear; never a reason to stop supervising.
            self.queue.put_nowait(HostNotReady(f"cannot check the host: {exc}"))

    async def _clean_host_once(self) -> None:
        record = self.store.load()
        recorded = set(record.processes) if record else set()
        leftovers = recorded | set(self.owner.marked_processes())
        if leftovers:
            self.log.warning(
                "removing processes of an earlier launch",
                pids=sorted(i.pid for i in leftovers),
            )
            stuck = await self.owner.sweep(leftovers)
            if stuck:
                pids = ", ".join(str(i.pid) for i in stuck)
                self.queue.put_nowait(
                    HostNotReady(
                        f"process {pids} of an earlier launch survives SIGKILL "
                        "(stuck in the kernel, D state): the host needs attention",
                        wedged=True,
                    )
                )
                return
        self.store.clear()
        # Paths on a mount not up yet, GPUs missing: host problems that may clear by themselves.
        spec = command.build(self.cfg, self.machine.ctx.profile)
        gpu_count = self._gpu_count if self.nvml is not None else None
        try:
            checks = await in_thread(
                lambda: preflight.host_checks(self.cfg, [spec], gpu_count), HOST_CHECK_TIMEOUT_S
            )
        except TimeoutError:
            limit = f"{HOST_CHECK_TIMEOUT_S:g}s"
            self.queue.put_nowait(
                HostNotReady(f"model path checks did not return within {limit} (hung mount?)")
            )
            return
        problems = preflight.failures(checks)
        if problems:
            self.queue.put_nowait(HostNotReady(preflight.summary(problems)))
            return
        fds = _free_fds()
        if fds is not None and fds < FD_HEADROOM:
            # Spawning would fail with EMFILE and count as a crash; it is the host's problem
            # (often a scraper leaking connections to the admin port) and it can clear.
            self.queue.put_nowait(
                HostNotReady(
                    f"only {fds} file descriptors left to kimi-serve (RLIMIT_NOFILE); "
                    "leaked admin connections?"
                )
            )
            return

        if self.cfg.gpus.manage and self.nvml is not None:
            # No launch of ours runs during cleaning, so nothing is `current`.
            report = await gpu.clean(
                self.cfg.gpus,
                self.nvml,
                current=set(),
                recorded=recorded,
                owner=self.owner.owner,
            )
            self.host = report.to_dict()
            for index, count in report.killed.items():
                uuid = self._uuid_of(index)
                self.metrics.gpu_killed.labels(str(index), uuid).inc(count)
            if report.release_seconds is not None:
                self.metrics.gpu_release.set(report.release_seconds)
            self._gpus_cache = (0.0, [])
            if not report.ok:
                self.queue.put_nowait(HostNotReady(report.message, wedged=bool(report.wedged)))
                return
        # After GPU cleaning: a leftover SGLang found only there may be what holds the port.
        port = preflight.check_port(self.cfg.sglang.host, self.cfg.sglang.port)
        if not port.ok:
            self.queue.put_nowait(HostNotReady(f"{port.message} (sglang.port)"))
            return
        self.queue.put_nowait(HostReady())

    def _launch(self, action: Launch) -> None:
        spec = self.spec = command.build(self.cfg, action.profile)
        self.scanner.reset()
        try:
            child = self.owner.spawn(action.launch, spec.argv, spec.env, self.cfg.sglang.workdir)
        except OSError as exc:
            msg = f"cannot start {spec.argv[0]}: {exc.strerror or exc} (sglang.python)"
            self.log.error("launch failed", error=msg)
            self.queue.put_nowait(LaunchFailed(action.launch, msg))
            return
        self.child = child
        self._save_record(child, action.profile)
        self.metrics.child_starts.inc()
        self.metrics.child_start_time.set(child.started_at)
        self.log.info("launched sglang", pid=child.pid, profile=action.profile, argv=spec.shell())
        self.queue.put_nowait(Launched(action.launch, child.pid))
        self._launch_tasks = [
            self._spawn(self._watch_port(action.launch)),
            self._spawn(self._watch_tree(child)),
        ]

    def _cancel_launch_watch(self, keep_tree: bool) -> None:
        for task in self._launch_tasks[:1] + ([] if keep_tree else self._launch_tasks[1:]):
            task.cancel()

    async def _watch_port(self, launch: int) -> None:
        await wait_port_open(self.cfg.sglang.host, self.cfg.sglang.port, interval=0.05)
        self.queue.put_nowait(PortOpen(launch))

    async def _watch_tree(self, child: Child) -> None:
        # Scheduler and detokenizer children appear during the first seconds of a launch;
        # record them as they appear so an escapee can be found by identity later.
        while child.alive():
            if self.owner.refresh_tree(child):
                self._save_record(child, self.machine.ctx.profile)
            fast = self.machine.state in STARTUP_STATES
            await asyncio.sleep(0.25 if fast else 5.0)

    def _save_record(self, child: Child, profile: str) -> None:
        try:
            self.store.save(LaunchRecord(os.getpid(), profile, tuple(sorted(child.known))))
        except OSError as exc:
            self.log.error(
                "cannot record the launch",
                path=str(self.store.path),
                error=exc.strerror or str(exc),
            )

    def _exited(self, child: Child) -> None:
        assert child.exit is not None
        self.queue.put_nowait(ChildExited(child.launch, child.exit.exit_code, child.exit.signal))
        self.log.info(
            "sglang exited", pid=child.pid, exit_code=child.exit.exit_code, signal=child.exit.signal
        )

    def _stop_child(self, action: StopChild) -> None:
        child = self.child
        if child is None or child.launch != action.launch:
            self.queue.put_nowait(ChildGone(action.launch, None, None))
            return
        if self._stopping is not None and not self._stopping.done():
            if not action.graceful:
                # Escalation (second SIGTERM): kill the group now; the running stop finishes.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGKILL)
            return

        async def stop() -> None:
            info = await self.owner.stop(child, action.graceful, self.cfg.stop.drain_timeout)
            if info.stuck:
                self.log.error("processes survive SIGKILL (D state?)", pids=list(info.stuck))
            else:
                self.store.clear()
            self.metrics.child_start_time.set(0)
            self._stopped_launch = child.launch
            self.queue.put_nowait(ChildGone(child.launch, info.exit_code, info.signal, info.stuck))

        self._stopping = self._spawn(stop())

    async def _probe(self, launch: int, kind: ProbeKind) -> None:
        cfg = self.cfg.readiness.probe
        timeout = cfg.timeout if kind is ProbeKind.READINESS else self.cfg.liveness.timeout
        base = server_url(self.cfg.sglang.host, self.cfg.sglang.port)
        spec = self.spec  # judged against what was launched
        # SGLang's own token counter, read around the probe: if it advanced while the probe
        # timed out, the server is loaded, not hung (and the failure does not count). The first
        # read runs beside the probe, so a frozen server costs one probe timeout, not more.
        sample = min(2.0, timeout)
        first = asyncio.get_running_loop().create_task(read_progress(self.http, base, sample))
        result = await probe(self.http, base, cfg, spec.speculative, timeout=timeout)
        before = await first
        busy = False
        if result.reason == "timeout" and before is not None:
            after = await read_progress(self.http, base, sample)
            busy = is_busy(result, before, after, cfg.max_tokens)
        # Queued before anything is logged: a broken log must never hide a verdict.
        self.queue.put_nowait(ProbeDone(launch, kind, result, busy))
        self._note_probe(kind, result, busy)

    def _note_probe(self, kind: ProbeKind, result: ProbeResult, busy: bool) -> None:
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
            "at": time.time(),
        }
        if not result.ok:
            self.log.warning(
                "probe failed", kind=kind.value, reason=result.reason, error=result.error, busy=busy
            )
        else:
            self.log.debug("probe ok", kind=kind.value, latency_s=result.latency_s)

    async def _check_intent(self, action: CheckIntent) -> None:
        base = server_url(self.cfg.sglang.host, self.cfg.sglang.port)
        info: dict[str, Any] | None = None
        for path in ("/server_info", "/get_server_info"):
            with contextlib.suppress(httpx.HTTPError, ValueError, TimeoutError):
                r = await self.http.get(base + path, timeout=10.0)
                if r.status_code == 200 and isinstance(r.json(), dict):
                    info = r.json()
                    break
        spec = self.spec  # judged against what was launched
        if info is None:
            self.intent = {"checked": False, "mismatches": [], "error": "server_info unavailable"}
            return
        mismatches = intent.compare(spec, info, action.probe.meta)
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

    def _record_restart(self, action: RecordRestart) -> None:
        self.restarts[action.reason.value] += 1
        self.metrics.restarts.labels(action.reason.value).inc()
        tail = self.scanner.tail()
        self.last_restart = {
            "reason": action.reason.value,
            "at": time.time(),
            "exit_code": action.exit_code,
            "signal": action.signal,
            "detail": action.detail,
            "profile": self.machine.ctx.profile,
            "log_tail": tail,
        }
        self.log.error(
            "sglang restart",
            reason=action.reason.value,
            detail=action.detail,
            exit_code=action.exit_code,
            signal=action.signal,
            log_tail=tail[-30:],
        )

    # ============================================================ log pump

    def _lines(self, launch: int, stream: Stream, lines: list[str]) -> None:
        self.metrics.log_lines.labels(stream.value).inc(len(lines))
        now = self.clock()
        # A token bucket refilled continuously: forwarding is spread over the second instead
        # of one burst at its start, during which SGLang's pipe would fill.
        tokens, last = self._forward
        tokens = min(FORWARD_BURST, tokens + (now - last) * FORWARD_PER_SECOND)
        if self._suppressed and now - self._suppressed_since >= 1.0:
            self.log.warning(
                "sglang log flood: lines not forwarded (still scanned)",
                suppressed=self._suppressed,
            )
            self.metrics.log_suppressed.inc(self._suppressed)
            self._suppressed = 0
        for line in lines:
            verdict = self.scanner.feed(line)
            if tokens >= 1.0:
                tokens -= 1.0
                level = guess_level(line)
                getattr(self.sglog, level)(line, source="sglang", stream=stream.value)
            else:
                if not self._suppressed:
                    self._suppressed_since = now
                self._suppressed += 1
            if verdict.ready:
                self.queue.put_nowait(ReadyLine(launch))
            elif verdict.fatal:
                self.queue.put_nowait(FatalLog(launch, self.scanner.evidence[:300]))
            elif verdict.fatal_pending:
                asyncio.get_running_loop().call_later(
                    FATAL_SETTLE_S, self.queue.put_nowait, _Settle(launch)
                )
        self._forward = (tokens, now)

    # ============================================================ reload

    async def _read_config(self) -> None:
        """SIGHUP: read and check the file off the loop (a hung mount must not stall it)."""
        if self._ever_ready:
            self.notifier.reloading()
        path = self.cfg.path

        def read() -> Config:
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise ConfigError(path, [ConfigIssue("", None, "is not a regular file")])
            new = config_mod.load(path)
            # A flag the installed SGLang rejects makes the new config invalid too: refusing it
            # here keeps the running server instead of trading it for a crash loop.
            checks = preflight.run_checks(new)
            problems = preflight.failures(checks, preflight.CONFIG)
            if problems:
                raise ConfigError(path, [ConfigIssue("", None, preflight.summary(problems))])
            return new

        result: Config | ConfigError
        try:
            result = await in_thread(read, RELOAD_TIMEOUT_S)
        except ConfigError as exc:
            result = exc
        except (OSError, TimeoutError) as exc:
            reason = str(exc) or f"no answer within {RELOAD_TIMEOUT_S:g}s (hung mount?)"
            result = ConfigError(path, [ConfigIssue("", None, f"cannot read: {reason}")])
        self.queue.put_nowait(_Reloaded(result))

    def _apply_config(self, new: Config | ConfigError) -> None:
        if isinstance(new, ConfigError):
            self.log.error(
                "reload refused: keeping the running configuration",
                errors=new.render().splitlines(),
            )
            self._reloaded(f"{self.status_line()} (reload refused: config invalid)")
            return
        if _comparable(new) == _comparable(self.cfg):
            self.log.info("reload: configuration unchanged")
            self._reloaded(self.status_line())
            if self.machine.state is State.FAILED:
                # `failed` lasts until a reload: the operator fixed the host, not the file.
                self._dispatch(RestartRequested(Reason.RELOAD, back_to_primary=True))
            return
        if (new.admin, new.state_dir, new.logging) != (
            self.cfg.admin,
            self.cfg.state_dir,
            self.cfg.logging,
        ):
            self.log.warning("reload: admin.listen, state_dir and logging apply at next start")
        self.cfg = new
        self.machine.cfg = new
        self.scanner = LogScanner(new.logs.fatal_patterns, new.logs.tail_lines)
        self.log.info("reload: configuration changed, restarting SGLang")
        self._reloaded(self.status_line())
        self.metrics.set_profile(self.machine.ctx.profile, new.profile_names)
        self._dispatch(RestartRequested(Reason.RELOAD, back_to_primary=True))

    def _reloaded(self, status: str) -> None:
        # READY=1 ends systemd's reload job, but before the first decode it would end the start
        # job too: units ordered after us would start while SGLang is still loading.
        if self._ever_ready:
            self.notifier.ready(status)
        else:
            self.notifier.status(status)

    # ============================================================ periodic

    async def _ticker(self) -> None:
        """WATCHDOG=1 while the loop is healthy; EXTEND_TIMEOUT_USEC while starting/stopping."""
        wd = watchdog_interval()
        last_extend = last_ping = -EXTEND_EVERY_S - (wd or 0.0)
        while True:
            now = self.clock()
            if wd is not None and now - last_ping >= wd and self.loop_healthy():
                self.notifier.watchdog()
                last_ping = now
            if extends_job(self.machine.state, self._ever_ready) and (
                now - last_extend >= EXTEND_EVERY_S
            ):
                self.notifier.extend_timeout(
                    EXTEND_BY_S
                    + self.cfg.stop.drain_timeout * (self.machine.state is State.STOPPING)
                )
                self.notifier.status(self.status_line())
                last_extend = now
            self._beat = now
            await asyncio.sleep(min(wd or 1.0, 1.0))

    # ============================================================ admin backend

    def loop_healthy(self) -> bool:
        return self.clock() - self._beat < 5.0

    def is_ready(self) -> bool:
        return self.machine.state in (State.READY, State.DEGRADED)

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def request_restart(self) -> str | None:
        if self.machine.state in (State.STOPPING, State.STOPPED):
            return "the daemon is stopping"
        self.queue.put_nowait(RestartRequested(Reason.MANUAL))
        return None

    def status_line(self) -> str:
        ctx = self.machine.ctx
        state = ctx.state
        parts = [state.value, f"({ctx.profile}"]
        if state in (State.LAUNCHING, State.LOADING, State.WARMING) and ctx.launched_at:
            parts[-1] += f", {self.clock() - ctx.launched_at:.0f} s"
        parts[-1] += ")"
        if state is State.LOADING:
            parts.append(f"- waiting for port {self.cfg.sglang.port}")
        elif state is State.WARMING:
            parts.append("- decode probe")
        elif state in (State.READY, State.DEGRADED) and self.last_probe:
            parts.append(f"- probe {self.last_probe['latency_s'] * 1000:.0f} ms")
            if state is State.DEGRADED:
                parts.append(
                    f"failing {ctx.liveness_failures}/{self.cfg.liveness.failure_threshold}"
                )
        if self.detail and state in (State.RESTARTING, State.FAILED, State.CLEANING):
            parts.append(f"- {self.detail}")
        return " ".join(parts)[:400]

    def _gpu_status(self) -> list[dict[str, Any]]:
        if self.nvml is None:
            return []
        at, cached = self._gpus_cache
        if self.clock() - at < 2.0 and cached:
            return cached
        try:
            snaps = nvml.select(self.nvml.snapshot(), self.cfg.gpus.devices)
            cached = nvml.gpu_status(snaps)
        except Exception as exc:  # a lost GPU must not break /status or /metrics
            self.log.warning("gpu snapshot failed", error=str(exc))
            cached = []
        self._gpus_cache = (self.clock(), cached)
        return cached

    def _uuid_of(self, index: int) -> str:
        for g in self._gpu_status():
            if g["index"] == index:
                return str(g["uuid"])
        return ""

    def status_document(self) -> dict[str, Any]:
        ctx = self.machine.ctx
        child = self.child if self.child is not None and self.child.alive() else None
        return {
            "state": ctx.state.value,
            "since": self._since_unix,
            "detail": self.detail,
            "status_line": self.status_line(),
            "profile": ctx.profile,
            "version": __version__,
            "sglang_version": self.sglang_version,
            "config": self.cfg.path,
            "child": None
            if child is None
            else {
                "pid": child.pid,
                "started_at": child.started_at,
                "launch": child.launch,
                "processes": sorted(i.pid for i in child.known),
            },
            "restarts": dict(self.restarts),
            "last_restart": self.last_restart,
            "last_probe": self.last_probe,
            "liveness_failures": ctx.liveness_failures,
            "gpus": self._gpu_status(),
            "host": self.host,
            "intent": self.intent,
            "events": list(self.events),
        }


def extends_job(state: State, ever_ready: bool) -> bool:
    """Whether systemd's start (or stop) job is still running and must be extended.

    Until the first READY=1 the start job runs: it is extended through loads, probes and the
    backoffs between them, or a crash loop would time the start out before the fallback profile
    is ever tried. Not in `failed`: a start that cannot succeed should fail, not hang
    `systemctl start` for ever.
    """
    if state is State.STOPPING:
        return True
    return not ever_ready and state in (*STARTUP_STATES, State.RESTARTING)


def _free_fds() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        return soft - len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def raise_fd_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: SGLang and the admin endpoint share it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _comparable(cfg: Config) -> Any:

    from dataclasses import replace

    return replace(cfg, path="")
