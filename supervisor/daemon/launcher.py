"""One launch of SGLang: spawn it (`Launch`), watch it (port, process tree), stop it
(`StopChild`). Every signal goes through `process.ProcessOwner`; every answer is an event.

- `Launch` answers `Launched` or `LaunchFailed` at once, then `PortOpen` once the port accepts.
- The descendants are recorded as they appear (every 0.25 s while starting, 5 s after) under
  `state_dir/launch.json`, so a daemon that was SIGKILLed finds them on its next start.
- `StopChild` answers `ChildGone` once every process of the launch is gone (or stuck). A
  non-graceful `StopChild` for a launch already being stopped cuts the drain short.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import httpx

from supervisor import log
from supervisor.config import Config
from supervisor.core.machine import (
    STARTUP_STATES,
    ChildExited,
    ChildGone,
    Context,
    Event,
    Launch,
    Launched,
    LaunchFailed,
    PortOpen,
    StopChild,
    WatchesEnd,
)
from supervisor.daemon.links import RouterSlot
from supervisor.daemon.observed import Observed
from supervisor.process import Child, ProcessOwner, wait_port_open
from supervisor.process.identity import LaunchRecord, RecordStore
from supervisor.router import RouterLink
from supervisor.sglang import api_key as sglang_key
from supervisor.sglang import argv as command
from supervisor.sglang.argv import LaunchSpec
from supervisor.sglang.probe import server_url

if TYPE_CHECKING:
    from supervisor.incidents.recorder import IncidentRecorder

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


class Launcher:
    def __init__(
        self,
        cfg: Config,
        ctx: Context,
        owner: ProcessOwner,
        store: RecordStore,
        observed: Observed,
        emit: Callable[[Event], None],
        spawn: Spawn,
        links: RouterSlot | None = None,
        http: httpx.AsyncClient | None = None,
        recorder: IncidentRecorder | None = None,
    ) -> None:
        self.cfg = cfg
        self.http = http  # the probes' client: it sends SGLang's API key (sglang_key.Bearer)
        self.ctx = ctx  # read only: the profile and whether the launch is still starting
        self.owner = owner
        self.store = store
        self.observed = observed
        self.emit = emit
        self.spawn = spawn
        self.links = links or RouterSlot()  # a stop waits until the router stops sending here
        self.log = log.get()
        self.child: Child | None = None
        self.spec: LaunchSpec = command.build(cfg)  # the current launch's command line
        self._port_watch: asyncio.Task[Any] | None = None
        self._tree_watch: asyncio.Task[Any] | None = None
        # Takes the stacks of a live, broken launch before its kill.
        self.recorder = recorder

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg

    @property
    def router(self) -> RouterLink | None:
        """The link a stop waits on: one a reload removed still deregisters first."""
        return self.links.for_stop

    def launch(
        self, action: Launch, before: Callable[[], None], spec: LaunchSpec | None = None
    ) -> None:
        """`spec`: a rollback's command (the last known good's, daemon/upgrades.py); else the
        configuration's. A rollback without one fails the launch: never the config instead."""
        if action.lkg and spec is None:
            msg = "the last known good's command cannot be rebuilt from a root-owned source"
            self.log.error("launch failed", error=msg)
            self.emit(LaunchFailed(action.launch, msg))
            return
        spec = self.spec = spec or command.build(self.cfg, action.profile)
        before()
        if not self._hand_over_key(action.launch):
            return
        try:
            child = self.owner.spawn(action.launch, spec.argv, spec.env, self.cfg.sglang.workdir)
        except OSError as exc:
            msg = f"cannot start {spec.argv[0]}: {exc.strerror or exc} (sglang.python)"
            self.log.error("launch failed", error=msg)
            self.emit(LaunchFailed(action.launch, msg))
            return
        self.child = child
        self._save_record(child, action.profile)
        self.observed.launched(child)
        self.log.info("launched sglang", pid=child.pid, profile=action.profile, argv=spec.shell())
        self.emit(Launched(action.launch, child.pid))
        self._port_watch = self.spawn(self._watch_port(action.launch))
        self._tree_watch = self.spawn(self._watch_tree(child))

    def adopted(self, child: Child, spec: LaunchSpec, profile: str) -> None:
        """A launch a hand-over passed on (daemon.handover.adopt): watched as if launched here,
        but neither counted as a start nor given a port watch (it serves already). Its requests
        carry the key that launch was given, as a launch's do."""
        self.child, self.spec = child, spec
        key, problem = sglang_key.launched_key(self.cfg)
        if problem:
            self.log.error("hand-over: SGLang's API key", error=problem)
        self._send_key(key)
        self.observed.child = child
        self._save_record(child, profile)
        self._tree_watch = self.spawn(self._watch_tree(child))

    def end_watches(self, which: WatchesEnd) -> None:
        if which.port and self._port_watch is not None:
            self._port_watch.cancel()
        if which.tree and self._tree_watch is not None:
            self._tree_watch.cancel()

    async def _watch_port(self, launch: int) -> None:
        await wait_port_open(self.cfg.sglang.host, self.cfg.sglang.port, interval=0.05)
        self.emit(PortOpen(launch))

    async def _watch_tree(self, child: Child) -> None:
        # Scheduler and detokenizer children appear during the first seconds of a launch;
        # record them as they appear so an escapee can be found by identity later.
        while child.alive():
            if self.owner.refresh_tree(child):
                self._save_record(child, self.ctx.profile)
            fast = self.ctx.state in STARTUP_STATES
            await asyncio.sleep(0.25 if fast else 5.0)

    def _hand_over_key(self, launch: int) -> bool:
        """SGLang's API key into the file its `--config` names, and onto every request of the
        probes' client; False (the launch failed, said why) when the key file is unusable."""
        try:
            key = sglang_key.configured_key(self.cfg)
            if self.cfg.sglang.api_key_file and key is not None:
                sglang_key.write_secrets(self.cfg.state_dir, key)
        except (sglang_key.KeyFileError, OSError) as exc:
            msg = f"sglang.api_key_file: {exc}"
            self.log.error("launch failed", error=msg)
            self.emit(LaunchFailed(launch, msg))
            return False
        self._send_key(key)
        return True

    def _send_key(self, key: str | None) -> None:
        """`key` on every request of the probes' client to SGLang (none: no Authorization)."""
        if self.http is not None:
            base = server_url(self.cfg.sglang.host, self.cfg.sglang.port)
            self.http.auth = httpx.Auth() if key is None else sglang_key.Bearer(base, key)

    def _save_record(self, child: Child, profile: str) -> None:
        try:
            self.store.save(LaunchRecord(os.getpid(), profile, tuple(sorted(child.known))))
        except OSError as exc:
            self.log.error(
                "cannot record the launch",
                path=str(self.store.path),
                error=exc.strerror or str(exc),
            )

    def exited(self, child: Child) -> None:
        assert child.exit is not None
        ended = child.exit
        self.emit(ChildExited(child.launch, ended.exit_code, ended.signal, process=ended.process))
        self.log.info(
            "sglang exited",
            pid=child.pid,
            exit_code=ended.exit_code,
            signal=ended.signal,
            process=ended.process or "main",
        )

    def stop(self, action: StopChild) -> None:
        child = self.child
        if child is None or child.launch != action.launch:
            self.emit(ChildGone(action.launch, None, None))
            return
        if child.stop_begun:
            if not action.graceful:
                self.owner.hurry(child)
            return

        async def stop() -> None:
            if self.router is not None:
                # The machine's RouterDeregister came just before; a second SIGTERM (hurry)
                # stops waiting for it.
                settled = asyncio.ensure_future(self.router.settled())
                hurried = asyncio.ensure_future(child.hurry.wait())
                await asyncio.wait((settled, hurried), return_when=asyncio.FIRST_COMPLETED)
                hurried.cancel()
            if not action.graceful:
                await self._before_kill(child)
            info = await self.owner.stop(child, action.graceful, self.cfg.stop.drain_timeout)
            if info.stuck:
                self.log.error("processes survive SIGKILL (D state?)", pids=list(info.stuck))
            else:
                self.store.clear()
            self.observed.stopped()
            self.emit(ChildGone(child.launch, info.exit_code, info.signal, info.stuck))

        child.stop_begun = True
        self.spawn(stop())

    async def _before_kill(self, child: Child) -> None:
        """Stacks of every process of the launch while they still exist, within
        incidents.dump_timeout; the recorder decides whether the reason is worth a dump."""
        if self.recorder is None:
            return
        self.owner.refresh_tree(child)  # a worker forked since the last tree scan
        reason = self.ctx.pending.value if self.ctx.pending is not None else "stop"
        pids = [child.pid, *sorted(i.pid for i in child.known if i.pid != child.pid)]
        cap = await self.recorder.before_kill(reason, pids)
        if cap is not None:
            self.log.info(
                "stacks taken before the kill",
                seconds=round(cap.seconds, 3),
                dumped=sum(s.ok for s in cap.stacks),
                processes=len(cap.stacks),
                reason=cap.reason,
            )

    async def teardown(self) -> None:
        """Whatever ended the loop, the current launch is stopped unless its stop completed
        (killpg and the sweep are idempotent)."""
        child = self.child
        if child is not None and not child.stop_done:
            await self.owner.stop(child, graceful=False, drain_timeout=0)
            self.store.clear()
