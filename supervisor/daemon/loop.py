"""The loop: take an event, let the machine decide, carry out the actions.

Signal handlers, timers, the log pump, probes and process watchers only produce events, through
`emit` (or by returning one from a task started with `_run`); nothing but the machine changes
state, and nothing here decides. What each action does lives in the module named for its
concern: `launcher` (spawn, watch, stop), `host` (cleaning before a launch), `probing` (decode
probe, intent check), `reload` (SIGHUP), `logpump` (SGLang's lines), `observed` (/status and
the metrics). The effects themselves come in as one `Effects` object.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from supervisor import admin, log, router, warm
from supervisor import secret_files as admin_token
from supervisor.config import Config, ConfigError
from supervisor.core.machine import (
    SERVING,
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
    HostReady,
    Launch,
    Machine,
    NotifyReady,
    NotifyReloaded,
    NotifyReloading,
    PortOpen,
    ProbeDone,
    ProbeKind,
    ProfileChanged,
    ReadConfig,
    Reason,
    RecordRestart,
    ReloadRequested,
    RestartRequested,
    RouterDeregister,
    RouterRegister,
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
    extends_job,
    watches_end,
)
from supervisor.daemon import group, host, probing, reload, startup
from supervisor.daemon.effects import Effects
from supervisor.daemon.launcher import Launcher
from supervisor.daemon.logpump import LogPump
from supervisor.daemon.notify import watchdog_interval
from supervisor.daemon.observed import Observed
from supervisor.daemon.quality_watch import QualityWatch
from supervisor.exits import EX_CONFIG
from supervisor.gpu import fitness_watch
from supervisor.gpu.nvml import Nvml
from supervisor.incidents import stacks
from supervisor.incidents.recorder import IncidentRecorder
from supervisor.sglang import probe

# Systemd's start job is extended by this much each time, while loading a 10-minute model.
EXTEND_BY_S = 30.0
EXTEND_EVERY_S = 10.0
LOOP_ERROR_EVERY_S = 60.0
# /livez fails when the loop has not turned for this long.
LOOP_STALE_S = 5.0


@dataclass(frozen=True)
class _Read:
    """The reloaded file as read, judged on the loop against the running configuration."""

    config: Config | ConfigError


Item = Event | _Read


class Daemon:
    def __init__(self, cfg: Config, effects: Effects | None = None) -> None:
        fx = effects or Effects.real(cfg)
        self.cfg = cfg
        self.fx = fx
        self.clock = fx.clock
        self.notifier = fx.notifier
        self.metrics = fx.metrics
        self.log = log.get()
        self.machine = Machine(cfg, self.clock())
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.observed = Observed(cfg, self.machine.ctx, fx.metrics, fx.clock, fx.wall)
        # The evidence of each restart nobody asked for (docs/incidents.md).
        self.recorder = IncidentRecorder(cfg, wall=fx.wall)
        self.observed.recorder = self.recorder
        # Serving quality: the canary, decode speed, accept length, graphs (docs/quality.md).
        self.quality = self.observed.quality = QualityWatch(cfg, fx.http, fx.metrics, self.emit)
        self.pump = LogPump(cfg, fx.metrics, fx.clock, self.emit, on_line=self._line)
        self.router = self.observed.router = router.link_for(
            cfg, self.log, fx.metrics, fx.router_http
        )
        self.launcher = Launcher(
            cfg,
            self.machine.ctx,
            fx.owner,
            fx.store,
            self.observed,
            self.emit,
            self._spawn,
            self.router,
            http=fx.http,
        )
        self.launcher.recorder = self.recorder
        # Caches made and measured, weights prewarmed, before each launch (docs/benchmarks.md).
        self.warm = warm.Warm(
            cfg, fx.clock, self._spawn, lambda: self.notifier.status(self.status_line())
        )
        self.recorder.load_extras = self.warm.current
        self.observed.note = self.warm.note
        fx.owner.bind(self.pump.lines, self.launcher.exited)
        self._timers: dict[TimerName, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._exit_code: int | None = None
        self._internal_error = False
        self._beat = self.clock()
        self._preparing = False
        self._loop_errors: dict[str, float] = {}
        # GPU fitness (gpus.manage): read before every launch, NVML's critical events watched.
        self.monitor: fitness_watch.Monitor | None = None
        # At most one decode probe in flight against SGLang; a timed-out one is aborted.
        self.gate = probe.ProbeGate()
        # A multi-node replica coordinated over the admin endpoints (docs/multinode.md).
        self.group = self.observed.group = (
            group.Group(cfg, self.machine.ctx, fx.http, self.emit, fx.clock, fx.metrics)
            if cfg.group.answers
            else None
        )

    @property
    def nvml(self) -> Nvml | None:
        """Opened by startup.prepare; kept where /status reads it."""
        return self.observed.nvml

    # ============================================================ lifecycle

    async def run(self) -> int:
        # Before anything is spawned: SGLang must not inherit the daemon's CAP_SYS_PTRACE
        # (py-spy alone gets it, stacks._spawn).
        stacks.confine()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.emit, StopRequested(sig.name))
        loop.add_signal_handler(signal.SIGHUP, self.emit, ReloadRequested())
        # asyncio's default handler prints raw tracebacks (e.g. accept() failing with EMFILE).
        loop.set_exception_handler(self._loop_exception)
        host.raise_fd_limit()
        shutdown_admin: Callable[[], Any] | None = None
        try:
            # Started first: preflight runs SGLang's parser (seconds, up to minutes on a cold
            # disk) and systemd's start timeout must be extended meanwhile.
            self._spawn(self._ticker())
            # The admin port next, before anything slow: bound after preflight, it was free for
            # seconds to minutes at every start, for any local user to take (and with it the
            # operator's token, sent by `kimi-serve status`); see docs/security.md.
            try:
                startup.check_state_dir(self.cfg, self.fx)
            except startup.CannotStart as exc:
                return self._fatal(str(exc), exc.code)
            on_drain, on_undrain = router.drain_ops(self)
            try:
                served = await admin.open_endpoint(
                    self,
                    self.cfg.admin.host,
                    self.cfg.admin.port,
                    on_drain=on_drain,
                    on_undrain=on_undrain,
                    group=self.group,
                )
                shutdown_admin = served.stop
            except admin_token.TokenFileError as exc:
                return self._fatal(f"{exc} (admin.token_file in {self.cfg.path})", EX_CONFIG)
            except OSError as exc:
                return self._fatal(
                    f"cannot serve the admin endpoint on {self.cfg.admin.listen}: "
                    f"{exc.strerror or exc}{admin.holder(self.cfg.admin.host, self.cfg.admin.port)}"
                    f" (admin.listen in {self.cfg.path})",
                    1,
                )
            self.log.info("admin endpoint", url=f"http://{self.cfg.admin.listen}/status")
            self._preparing = True
            try:
                code = await self._prepare()
            finally:
                self._preparing = False
            if code is not None:
                return code
            self.monitor = self.observed.monitor = await fitness_watch.start(
                self.nvml, self.cfg.gpus.devices, self.emit, self.metrics, self.log, self._spawn
            )
            # Whatever a previous run left in the router's list is not decode-verified.
            router.carry_out(self.router, RouterDeregister(0, "startup", wait_idle=False))
            self.observed.profile(None, self.machine.ctx.profile)
            if self.group is not None:
                self._spawn(self.group.run())
            self.emit(Start())
            while self._exit_code is None:
                self.dispatch(await self.queue.get())
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
            await startup.prepare(self.cfg, self.fx, self.observed)
        except startup.CannotStart as exc:
            return self._fatal(str(exc), exc.code)
        return None

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
        with contextlib.suppress(Exception):
            await self.launcher.teardown()
        for handle in self._timers.values():
            handle.cancel()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if shutdown_admin is not None:
            with contextlib.suppress(Exception):
                await shutdown_admin()
        await router.close_link(self.router)
        await self.fx.http.aclose()
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.close()

    # ============================================================ events in

    def emit(self, event: Event | _Read) -> None:
        """The one way an effect hands an event to the loop."""
        self.queue.put_nowait(event)

    def _run(self, coro: Coroutine[Any, Any, Event | _Read | None]) -> None:
        """Run an effect as a task; the event it returns is emitted."""

        async def run() -> None:
            event = await coro
            if event is not None:
                self.emit(event)

        self._spawn(run())

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
            self.emit(StopRequested("internal-error"))
            self.log.error("internal task failed; stopping", error=repr(exc))
            self.log.debug("internal task traceback", exc_info=exc)

    # ============================================================ the loop

    def dispatch(self, item: Item) -> None:
        self._beat = self.clock()
        if isinstance(item, _Read):
            verdict = reload.judge(self.cfg, item.config, self.observed.refused_reload)
            if isinstance(item.config, Config) and verdict is not Verdict.INVALID:
                self._take(item.config, verdict)
            item = ConfigRead(verdict)
        elif isinstance(item, ChildExited | ChildGone):
            # A traceback whose end never came is the death's cause: its verdict goes first.
            fatal = self.pump.settle_now(item.launch)
            if fatal is not None:
                self.dispatch(fatal)
        self._observe(item)
        for action in self.machine.handle(item, self.clock()):
            self._do(action)

    def _do(self, action: Action) -> None:
        match action:
            case Transitioned():
                self.warm.transitioned(action, self.machine.ctx.profile)
                self.observed.transitioned(action)
                if action.new is State.STOPPING:
                    self.notifier.stopping(self.status_line())
                else:
                    self.notifier.status(self.status_line())
                self.launcher.end_watches(watches_end(action))
                if self.group is not None:
                    self.group.transitioned(action)
            case CleanHost():
                fx, profile = self.fx, self.machine.ctx.profile
                cleaned = host.clean(
                    self.cfg, profile, fx.store, fx.owner, self.nvml, self.observed, self.monitor
                )
                self._run(self._clean_then_join(cleaned))
            case Launch():
                self.launcher.launch(action, before=self.pump.new_launch)
                if self.launcher.child is not None and self.launcher.child.launch == action.launch:
                    self.recorder.launched(action.launch, action.profile, self.clock())
                    self.quality.launched(action.launch, self.launcher.spec)
            case StartProbe():
                self._spawn(self._probe(action))
            case StopChild():
                self.launcher.stop(action)
            case SetTimer():
                self._cancel_timer(action.name)
                event = TimerFired(action.name, action.launch)
                loop = asyncio.get_running_loop()
                self._timers[action.name] = loop.call_later(action.delay, self.emit, event)
            case CancelTimer():
                self._cancel_timer(action.name)
            case NotifyReady():
                self.notifier.ready(self.status_line())
            case RecordRestart():
                tail = self.pump.tail()
                self.observed.restart(action, tail)
                self.observed.incident_written(
                    self.recorder.record(
                        action.reason.value,
                        action.detail,
                        action.exit_code,
                        action.signal,
                        tail,
                        self.observed.gpu_status(),
                    )
                )
            case ProfileChanged():
                self.observed.profile(action.old, action.new)
            case CheckIntent():
                self._spawn(self._intent(action))
            case ReadConfig():
                self._run(self._read_config())
            case NotifyReloading():
                self.notifier.reloading()
            case NotifyReloaded():
                # READY=1 ends systemd's reload job; before the first decode it would end the
                # start job too, so the machine says which.
                line = f"{self.status_line()}{action.note}"
                if action.ready:
                    self.notifier.ready(line)
                else:
                    self.notifier.status(line)
            case RouterRegister() | RouterDeregister():
                router.carry_out(self.router, action)
            case Exit():
                self._exit_code = 1 if self._internal_error else action.code

    def _observe(self, item: Event) -> None:
        """The load timeline's marks that come as events (docs/incidents.md)."""
        child = self.launcher.child
        if child is None or getattr(item, "launch", None) != child.launch:
            return
        match item:
            case PortOpen():
                self.recorder.port_open(self.clock())
            case ProbeDone(kind=ProbeKind.READINESS) if item.result.ok:
                now, took = self.clock(), item.result.latency_s
                self.metrics.set_load_phases(self.recorder.probe_ok(now, took))

    def _cancel_timer(self, name: TimerName) -> None:
        handle = self._timers.pop(name, None)
        if handle is not None:
            handle.cancel()

    # ============================================================ effects that answer

    async def _probe(self, action: StartProbe) -> None:
        spec = self.launcher.spec  # judged against what was launched
        # probing.decode reads SGLang's counters beside the probe (never before it: a frozen
        # server must not delay the hang's detection); the speed reading reuses that read.
        done = await probing.decode(
            self.fx.http, self.cfg, spec, action.launch, action.kind, gate=self.gate
        )
        before = done.progress_before
        decoded_before = None if before is None else before.realtime_decode
        if action.canary and done.result.ok:
            try:
                mismatch = await self.quality.canary(action.launch, self.gate)
            except Exception as exc:  # the probe's verdict must reach the machine regardless
                self.log.error("canary failed", error=f"{type(exc).__name__}: {exc}")
                mismatch = None
            done = dataclasses.replace(done, canary_mismatch=mismatch)
        # Queued before anything is logged: a broken log must never hide a verdict.
        self.emit(done)
        self.observed.probe(done.kind, done.result, done.busy)
        try:
            own = (done.result.completion_tokens or 0) + (
                self.cfg.quality.canary.max_tokens if action.canary else 0
            )
            await self.quality.probe_done(done, decoded_before, own)
        except Exception as exc:
            self.log.error("quality reading failed", error=f"{type(exc).__name__}: {exc}")

    def _line(self, line: str, mono_now: float) -> None:
        self.recorder.line(line, mono_now)
        self.quality.line(line)

    async def _intent(self, action: CheckIntent) -> None:
        info, mismatches = await probing.check_intent(
            self.fx.http, self.cfg, self.launcher.spec, action.probe.meta
        )
        if info is not None:
            self.recorder.server_info(info)
        self.observed.intent_checked(info, mismatches)

    async def _clean_then_join(self, cleaned: Coroutine[Any, Any, Event]) -> Event:
        """A follower launches only into the leader's next epoch (group.Group.join)."""
        event = await cleaned
        g, joins = self.group, isinstance(event, HostReady) and not self.machine.ctx.handing_over
        if joins and g is not None and g.role == "follower":
            await g.join()
        return event

    async def _read_config(self) -> _Read:
        return _Read(await reload.read(self.cfg.path))

    def _take(self, new: Config, verdict: Verdict) -> None:
        """A valid configuration replaces the running one, everywhere it is read."""
        ready = verdict is Verdict.UNCHANGED and self.machine.state is State.READY
        self.router = self.observed.router = router.relink(
            self.router, new, self.log, self.metrics, ready, self.fx.router_http
        )
        # A link a reload removed still deregisters before the stop that may follow.
        self.launcher.router = self.router or self.launcher.router
        self.cfg = self.machine.cfg = self.observed.cfg = self.launcher.cfg = self.warm.cfg = new
        self.pump.configure(new)
        self.recorder.reconfigure(new)
        self.quality.cfg = new
        if self.group is not None:
            self.group.cfg = new  # timings and token file (reload.judge refuses role, peers)
        self.observed.profile(None, self.machine.ctx.profile)

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
            state = self.machine.state
            if extends_job(state, self.machine.ctx.ever_ready) and (
                now - last_extend >= EXTEND_EVERY_S
            ):
                stopping = state is State.STOPPING
                self.notifier.extend_timeout(EXTEND_BY_S + self.cfg.stop.drain_timeout * stopping)
                self.notifier.status(self.status_line())
                last_extend = now
            self._beat = now
            await asyncio.sleep(min(wd or 1.0, 1.0))

    # ============================================================ admin backend

    def loop_healthy(self) -> bool:
        # Preflight awaits its checks on the loop, with no event to dispatch: the loop that
        # answers /livez meanwhile is the proof it runs.
        return self._preparing or self.clock() - self._beat < LOOP_STALE_S

    def is_ready(self) -> bool:
        if (child := self.launcher.child) is not None and child.dying:
            return False  # a worker died: the launch's end is being reported
        if self.group is not None:
            return self.group.ready()
        return self.machine.state in SERVING

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def request_restart(self) -> str | None:
        refused = self.machine.refuse_restart()
        if refused is None:
            self.emit(RestartRequested(Reason.MANUAL))
        return refused

    def request_drain(self) -> str | None:
        # Dispatched here, not queued: the deregistration must have begun when /drain awaits it.
        refused = self.machine.drain_refusal()
        if refused is None:
            self.dispatch(DrainRequested())
        return refused

    def request_undrain(self) -> str | None:
        refused = self.machine.undrain_refusal()
        if refused is None:
            self.dispatch(UndrainRequested())
        return refused

    def status_line(self) -> str:
        return self.observed.status_line()

    def status_document(self) -> dict[str, Any]:
        return self.observed.status_document()
