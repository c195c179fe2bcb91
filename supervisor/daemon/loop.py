"""The loop: take an event, let the machine decide, carry out the actions.

Signal handlers, timers, the log pump, probes and process watchers only produce events, through
`emit` (or by returning one from a task started with `Inbox.run`); nothing but the machine
changes state, and nothing here decides: what /readyz answers, the exit status, whether a
follower joins, how long systemd's job is extended are the machine's answers. What each action
does lives in the module named for its concern: `launcher` (spawn, watch, stop), `host`
(cleaning before a launch), `probing` (decode probe, intent check), `reload` (SIGHUP),
`logpump` (SGLang's lines), `observed` (/status and the metrics). The effects come in as one
`Effects` object, the parts built from them as one `wiring.Parts`; a reload reaches them all
through `reconfigure`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from supervisor import admin, log, router
from supervisor import secret_files as admin_token
from supervisor.config import Config
from supervisor.core import events as ev
from supervisor.core.machine import Verdict, watches_end
from supervisor.core.states import ProbeKind, State, TimerName
from supervisor.daemon import (
    adoption,
    handover,
    host,
    injected,
    probing,
    reload,
    signals,
    startup,
    upgrades,
)
from supervisor.daemon.answers import AdminAnswers
from supervisor.daemon.effects import Effects
from supervisor.daemon.inbox import Item
from supervisor.daemon.notify import watchdog_interval
from supervisor.daemon.quality_watch import CanaryOutcome
from supervisor.daemon.reload import Read
from supervisor.daemon.wiring import Parts, wire
from supervisor.exits import EX_CONFIG
from supervisor.gpu import fitness_watch
from supervisor.gpu.fitness_watch import Monitor
from supervisor.gpu.nvml import Nvml
from supervisor.incidents import stacks
from supervisor.router import RouterLink

EXTEND_EVERY_S = 10.0  # how often systemd's job is extended (by Machine.job_extension)
LOOP_ERROR_EVERY_S = 60.0


class Daemon(AdminAnswers):
    def __init__(self, cfg: Config, effects: Effects | None = None, parts: Parts | None = None):
        """Every part comes built (`wiring.wire`, unless the caller wired its own)."""
        fx = effects or Effects.real(cfg)
        p = parts or wire(cfg, fx)
        self.cfg = cfg
        self.fx = fx
        self.parts = p
        self.clock = fx.clock
        self.notifier = fx.notifier
        self.metrics = fx.metrics
        self.log = log.get()
        self.machine = p.machine
        self.inbox = p.inbox
        self.queue = p.inbox.queue
        self.observed = p.observed
        self.recorder = p.recorder
        self.quality = p.quality
        self.pump = p.pump
        self.launcher = p.launcher
        self.warm = p.warm
        self.gate = p.gate
        self.group = p.group
        self._timers: dict[TimerName, asyncio.TimerHandle] = {}
        self._exit_code: int | None = None
        self._beat = self.clock()
        self._preparing = False
        self._loop_errors: dict[str, float] = {}
        self.handover = handover.Handover(self)
        self.upgrades = upgrades.Upgrades(cfg)  # the last known good of each profile
        self.inbox.recover = self.handover.recover
        self.admin_served: admin.Served | None = None  # a hand-over passes its socket on
        self.strays = signals.Strays(self.log)

    @property
    def router(self) -> RouterLink | None:
        """The current link (a reload may add, move or remove it): router.DrainHost."""
        return self.parts.links.current

    @property
    def monitor(self) -> Monitor | None:
        """GPU fitness (gpus.manage): read before every launch, NVML's critical events watched."""
        return self.parts.gpus.monitor

    @property
    def nvml(self) -> Nvml | None:
        """Opened by startup.prepare (gpus.manage); /status reads the same holder."""
        return self.parts.gpus.nvml

    # ============================================================ lifecycle

    async def run(self) -> int:
        # Before anything is spawned: SGLang must not inherit the daemon's CAP_SYS_PTRACE
        # (py-spy alone gets it, stacks._spawn).
        stacks.confine()
        loop = asyncio.get_running_loop()
        for sig in signals.STOP:
            loop.add_signal_handler(sig, self.emit, ev.StopRequested(sig.name))
        loop.add_signal_handler(signals.RELOAD, self.emit, ev.ReloadRequested())
        # Every other signal that would end the daemon (and with it SGLang, KillMode=mixed):
        # logged; SIGUSR1 dumps the daemon's stacks.
        self.strays.install(loop)
        # A hand-over blocked them across its exec (daemon/handover.py); pending ones come now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handover.SIGNALS)
        inherited = adoption.take()
        if inherited is not None:  # before /metrics is served: the counter never goes back
            self.handover.carried(inherited.doc.get("counted"))
            # Every other counter too (restarts by reason, SGLang starts, log lines, probe
            # failures...): an upgrade must not hide a crash history.
            self.metrics.continue_counters(inherited.doc.get("counters"))
        # asyncio's default handler prints raw tracebacks (e.g. accept() failing with EMFILE).
        loop.set_exception_handler(self._loop_exception)
        host.raise_fd_limit()
        shutdown_admin: Callable[[], Any] | None = None
        try:
            # Started first: preflight runs SGLang's parser (seconds, up to minutes on a cold
            # disk) and systemd's start timeout must be extended meanwhile.
            self.inbox.spawn(self._ticker())
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
                    on_reexec=self.handover,
                    sock=None if inherited is None else inherited.admin,
                )
                shutdown_admin = served.stop
                self.admin_served = served
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
                code = await self._prepare(adoption.inherited_version(inherited))
            finally:
                self._preparing = False
            if code is not None:
                return code
            self.parts.gpus.monitor = await fitness_watch.start(
                self.nvml,
                self.cfg.gpus.devices,
                self.emit,
                self.metrics,
                self.log,
                self.inbox.spawn,
            )
            if self.group is not None:
                self.inbox.spawn(self.group.run())
            # Before the first launch is compared. After an exec, read on the loop (a few KiB in
            # the state dir, as the launch record is): awaited, the inherited admin socket would
            # answer /readyz 503 from `starting` before the adoption restores `ready`.
            lkgs = self.upgrades.known_now() if inherited else await self.upgrades.known()
            for known in lkgs:
                self.emit(known)
            if inherited is None or not adoption.adopt(self, inherited):
                # Whatever a previous run left in the router's list is not decode-verified.
                router.carry_out(self.router, ev.RouterDeregister(0, "startup", wait_idle=False))
                self.observed.profile(None, self.machine.ctx.profile)
                self.emit(ev.Start())
            while self._exit_code is None:
                item = await self.queue.get()
                try:
                    self.dispatch(item)
                except Exception as exc:  # the loop's own code: handed over as a task's is
                    if not self.handover.recover(exc):
                        raise
                    self.log.error("internal error; handing over", error=repr(exc))
            return self._exit_code
        except Exception as exc:  # never leave SGLang behind, whatever went wrong here
            # One line for the operator; the traceback only at debug level, for a bug report.
            self.log.error("internal error; stopping SGLang", error=repr(exc))
            self.log.debug("internal error traceback", exc_info=True)
            return 1
        finally:
            await self._teardown(shutdown_admin)

    async def _prepare(self, adopting: str | None = None) -> int | None:
        """Checks that must pass before any GPU or process is touched. An exit code, or None."""
        try:
            await startup.prepare(self.cfg, self.fx, self.observed, adopting)
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
        tasks = self.inbox.tasks
        for task in list(tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
        if shutdown_admin is not None:
            with contextlib.suppress(Exception):
                await shutdown_admin()
        await router.close_link(self.router)
        await self.fx.http.aclose()
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.close()

    # ============================================================ events in

    def emit(self, item: Item) -> None:
        """The one way an effect hands an event to the loop (Inbox.emit)."""
        self.inbox.emit(item)

    # ============================================================ the loop

    def dispatch(self, item: Item) -> None:
        self._beat = self.clock()
        injected.check("dispatch")
        if isinstance(item, Read):
            verdict = reload.judge(self.cfg, item.config, self.observed.refused_reload)
            if isinstance(item.config, Config) and verdict is not Verdict.INVALID:
                self.reconfigure(item.config, verdict)
            item = ev.ConfigRead(verdict)
        elif isinstance(item, ev.ChildExited | ev.ChildGone):
            # A traceback whose end never came is the death's cause: its verdict goes first.
            fatal = self.pump.settle_now(item.launch)
            if fatal is not None:
                self.dispatch(fatal)
        self._observe(item)
        for action in self.machine.handle(item, self.clock()):
            self._do(action)

    def _do(self, action: ev.Action) -> None:
        match action:
            case ev.Transitioned():
                self.warm.transitioned(action, self.machine.ctx.profile)
                self.observed.transitioned(action)
                if action.new is State.STOPPING:
                    self.notifier.stopping(self.status_line())
                else:
                    self.notifier.status(self.status_line())
                self.launcher.end_watches(watches_end(action))
                if self.group is not None:
                    self.group.transitioned(action)
            case ev.CleanHost():
                fx, profile = self.fx, self.machine.ctx.profile
                cleaned = host.clean(
                    self.cfg, profile, fx.store, fx.owner, self.nvml, self.observed, self.monitor
                )
                self.inbox.run(self._clean_then_join(cleaned))
            case ev.Launch():
                lkg = self.upgrades.spec_for(action.profile) if action.lkg else None
                self.launcher.launch(action, before=self.pump.new_launch, spec=lkg)
                if self.launcher.child is not None and self.launcher.child.launch == action.launch:
                    self.recorder.launched(action.launch, action.profile, self.clock())
                    self.quality.launched(action.launch, self.launcher.spec)
                    self.inbox.run(self.upgrades.compare(action.launch, self.launcher.spec))
            case ev.RecordLkg():
                child, why = self.launcher.child, self.machine.ctx.upgrade_why
                if child is not None and child.launch == action.launch:
                    self.inbox.spawn(self.upgrades.record(action, self.launcher.spec, why))
            case ev.RolledBack() | ev.UpgradeChanged():
                self.upgrades.carry_out(action, self.metrics, self.machine.ctx.on_lkg)
                self.notifier.status(self.status_line())
            case ev.StartProbe():
                self.inbox.spawn(self._probe(action))
            case ev.StopChild():
                self.launcher.stop(action)
            case ev.SetTimer():
                self._cancel_timer(action.name)
                event = ev.TimerFired(action.name, action.launch)
                loop = asyncio.get_running_loop()
                self._timers[action.name] = loop.call_later(action.delay, self.emit, event)
            case ev.CancelTimer():
                self._cancel_timer(action.name)
            case ev.NotifyReady():
                self.notifier.ready(self.status_line())
            case ev.RecordRestart():
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
            case ev.ProfileChanged():
                self.observed.profile(action.old, action.new)
            case ev.CheckIntent():
                self.inbox.spawn(self._intent(action))
            case ev.ReadConfig():
                self.inbox.run(self._read_config())
            case ev.NotifyReloading():
                self.notifier.reloading()
            case ev.NotifyReloaded():
                # READY=1 ends systemd's reload job; before the first decode it would end the
                # start job too, so the machine says which.
                line = f"{self.status_line()}{action.note}"
                if action.ready:
                    self.notifier.ready(line)
                else:
                    self.notifier.status(line)
            case ev.RouterRegister() | ev.RouterDeregister():
                router.carry_out(self.router, action)
            case ev.Exit():
                self._exit_code = action.code  # 1 after an internal error: Machine.internal_error

    def _observe(self, item: ev.Event) -> None:
        """The load timeline's marks that come as events (docs/incidents.md)."""
        child = self.launcher.child
        if child is None or getattr(item, "launch", None) != child.launch:
            return
        match item:
            case ev.PortOpen():
                self.recorder.port_open(self.clock())
            case ev.ProbeDone(kind=ProbeKind.READINESS) if item.result.ok:
                now, took = self.clock(), item.result.latency_s
                self.metrics.set_load_phases(self.recorder.probe_ok(now, took))
            case ev.ProbeDone(kind=ProbeKind.LIVENESS) if item.result.ok:
                adoption.probed(self)  # READY=1 after a hand-over's first decode
            case ev.ProbeDone(kind=ProbeKind.LIVENESS):
                adoption.probe_failed(self, item.result.error or item.result.reason or "failed")
            case ev.Launched():
                adoption.relaunched(self)  # a hand-over still probing SGLang fell back

    def _cancel_timer(self, name: TimerName) -> None:
        handle = self._timers.pop(name, None)
        if handle is not None:
            handle.cancel()

    # ============================================================ effects that answer

    async def _probe(self, action: ev.StartProbe) -> None:
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
                out = await self.quality.canary(action.launch, self.gate)
            except Exception as exc:  # the probe's verdict must reach the machine regardless
                self.log.error("canary failed", error=f"{type(exc).__name__}: {exc}")
                out = CanaryOutcome(unavailable=f"canary failed: {type(exc).__name__}")
            done = dataclasses.replace(
                done,
                canary_mismatch=out.mismatch,
                canary_unavailable=out.unavailable,
                known_failed=out.known_failed,
            )
        if action.kind is ProbeKind.READINESS and done.result.ok:
            tps, accept = self.quality.gate_readings(done)
            done = dataclasses.replace(done, gate_tps=tps, gate_accept=accept)
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

    async def _intent(self, action: ev.CheckIntent) -> None:
        info, mismatches = await probing.check_intent(
            self.fx.http, self.cfg, self.launcher.spec, action.probe.meta
        )
        if info is not None:
            self.recorder.server_info(info)
        self.observed.intent_checked(info, mismatches)

    async def _clean_then_join(self, cleaned: Coroutine[Any, Any, ev.Event]) -> ev.Event:
        """A follower launches only into the leader's next epoch (group.Group.join)."""
        event = await cleaned
        if self.group is not None and self.machine.joins_group(event):
            await self.group.join()
        return event

    async def _read_config(self) -> Read:
        return Read(await reload.read(self.cfg.path))

    def reconfigure(self, new: Config, verdict: Verdict) -> None:
        """A valid configuration replaces the running one, everywhere it is read: the router
        link is kept, moved, made or removed (`RouterSlot.relink`), then every part that holds
        the configuration takes it (`Parts.holders`)."""
        self.parts.links.relink(new, ready=self.machine.stays_ready(verdict))
        self.cfg = new
        for part in self.parts.holders():
            part.reconfigure(new)
        self.upgrades.reconfigure(new)
        self.observed.profile(None, self.machine.ctx.profile)

    # ============================================================ periodic

    async def _ticker(self) -> None:
        """WATCHDOG=1 while the loop is healthy; EXTEND_TIMEOUT_USEC while starting/stopping."""
        wd = watchdog_interval()
        last_extend = last_ping = -EXTEND_EVERY_S - (wd or 0.0)
        while True:
            injected.check("task")
            now = self.clock()
            if wd is not None and now - last_ping >= wd and self.loop_healthy():
                self.notifier.watchdog()
                last_ping = now
            extend = self.machine.job_extension()
            if extend is not None and now - last_extend >= EXTEND_EVERY_S:
                self.notifier.extend_timeout(extend)
                self.notifier.status(self.status_line())
                last_extend = now
            self._beat = now
            await asyncio.sleep(min(wd or 1.0, 1.0))
