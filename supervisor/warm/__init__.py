"""Before each launch: the compile caches made and measured, the weights prewarmed.

Driven by the machine's transitions (the daemon hands each one over): a round begins when a
launch is coming (RESTARTING, so it overlaps the backoff and the cleaning; CLEANING for the
first launch or one after `failed`) and its prewarm ends when SGLang's port opens (its weights
are in), or when the launch ends, fails or the daemon stops. Nothing here decides for the
machine and nothing waits for it: the launch goes ahead when the cleaning is done.

What a round reports goes into the launch's /status.last_load (`caches`, `prewarm`), the log
(`prewarm` events) and STATUS= (`note`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from supervisor import log, threads
from supervisor.config import Config
from supervisor.core.machine import State, Transitioned
from supervisor.sglang import argv, caches
from supervisor.warm import memory, prewarm

# Cache directories are made and measured within this; a hung file system only loses the report.
CACHES_TIMEOUT_S = 30.0
PLAN_TIMEOUT_S = 60.0
# A reader is abandoned after this (a hung disk); the launch never waited for it anyway.
READ_TIMEOUT_S = 3600.0
PROGRESS_EVERY_S = 5.0

BEGINS = frozenset({State.RESTARTING, State.CLEANING})
# The weights are in once the port opens; a round also ends with its launch.
ENDS = frozenset({State.WARMING, State.READY, State.FAILED, State.STOPPING, State.STOPPED})


@dataclass
class Round:
    profile: str
    clock: Callable[[], float]
    caches: dict[str, Any] | None = None
    progress: prewarm.Progress | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def document(self) -> dict[str, Any]:
        """`caches` and `prewarm` of /status.last_load (prewarm null when it did not run)."""
        p = self.progress
        return {
            "caches": self.caches,
            "prewarm": None if p is None or not p.started else p.document(self.clock()),
        }


class Warm:
    def __init__(
        self,
        cfg: Config,
        clock: Callable[[], float],
        spawn: Callable[[Coroutine[Any, Any, Any]], Any],
        on_progress: Callable[[], None] = lambda: None,
        *,
        memory_bound: Callable[[], memory.Bound] = memory.bound,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.spawn = spawn
        self.on_progress = on_progress  # STATUS= again, with the note
        self.memory_bound = memory_bound  # the host's and the memory cgroup's (warm.memory)
        self.log = log.get()
        self.round: Round | None = None
        self.done = asyncio.Event()  # the current round's work has ended (tests await it)

    # ------------------------------------------------------------ fed by the daemon

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg

    def transitioned(self, t: Transitioned, profile: str) -> None:
        if t.new in BEGINS and t.old is not t.new:
            r = self.round
            if r is not None and r.profile == profile and not r.stop.is_set():
                return  # RESTARTING -> CLEANING: the same round goes on
            self._end("superseded")
            self._begin(profile)
        elif t.new in ENDS:
            self._end(t.new.value)

    def current(self) -> Callable[[], dict[str, Any]] | None:
        """The current round's report, for the launch being made (recorder.load_extras)."""
        return None if self.round is None else self.round.document

    def note(self) -> str:
        """STATUS= addition while the prewarm of this round runs or just ran."""
        r = self.round
        if r is None or r.progress is None or not r.progress.started:
            return ""
        return prewarm.summary_line(r.progress, self.clock())

    # ------------------------------------------------------------ the round

    def _begin(self, profile: str) -> None:
        r = self.round = Round(profile, self.clock)
        self.done = asyncio.Event()
        self.spawn(self._run(r, self.done))

    def _end(self, why: str) -> None:
        r = self.round
        if r is None:
            return
        p = r.progress
        if p is not None and p.ended is None and not r.stop.is_set():
            p.stopped = p.stopped or f"launch reached {why}"
        r.stop.set()

    async def _run(self, r: Round, done: asyncio.Event) -> None:
        try:
            spec = argv.build(self.cfg, r.profile)
            dirs = caches.paths(spec.env)
            try:
                found = await threads.in_thread(lambda: caches.prepare(dirs), CACHES_TIMEOUT_S)
            except (TimeoutError, OSError) as exc:
                found = {name: {"path": path, "error": repr(exc)} for name, path in dirs.items()}
            r.caches = found
            self.log.info("caches", **{k: v.get("bytes") for k, v in found.items()})
            if self.cfg.warm.prewarm == "off" or r.stop.is_set():
                return
            models = prewarm.model_paths(self.cfg.sglang.model_path, spec.args)
            await self._prewarm(r, models)
        finally:
            done.set()

    async def _prewarm(self, r: Round, models: list[str]) -> None:
        w = self.cfg.warm
        headroom = w.prewarm_headroom
        try:
            bound = self.memory_bound()
            if headroom is None:
                headroom = prewarm.default_headroom(bound.total)
            files = prewarm.weight_files(models)
            available = bound.available
            plan = await threads.in_thread(
                lambda: prewarm.plan(files, available, headroom), PLAN_TIMEOUT_S
            )
        except (TimeoutError, OSError, MemoryError) as exc:  # a plan is never worth a stop
            self.log.warning("prewarm skipped", error=repr(exc))
            return
        p = r.progress = prewarm.Progress(
            planned=sum(c.length for c in plan.chunks),
            total=plan.total,
            resident_before=plan.resident_before,
            started=self.clock(),
            files=len(files),
        )
        if plan.skipped_for_memory:
            p.stopped = (
                f"memory: {plan.skipped_for_memory} bytes left out "
                f"({bound.source} {available} - headroom {headroom})"
            )
        self.log.info(
            "prewarm",
            files=len(files),
            total=plan.total,
            resident_before=plan.resident_before,
            to_read=p.planned,
            readers=w.prewarm_readers,
            left_out_for_memory=plan.skipped_for_memory,
            memory_available=available,
            memory_bound=bound.source,
        )
        readers = prewarm.Readers(
            plan.chunks, p, r.stop, headroom, lambda: self.memory_bound().available
        )
        jobs = [
            asyncio.ensure_future(threads.in_thread(readers.work, READ_TIMEOUT_S))
            for _ in range(min(w.prewarm_readers, max(1, len(plan.chunks))))
        ]
        pending: set[asyncio.Future[None]] = set(jobs)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=PROGRESS_EVERY_S)
            if pending:
                self.log.info("prewarm progress", read=p.read, planned=p.planned)
                self.on_progress()
        errors = [repr(j.exception()) for j in jobs if j.exception() is not None]
        if errors:
            r.stop.set()
            p.stopped = p.stopped or f"read failed: {errors[0]}"
        p.ended = self.clock()
        self.log.info("prewarm done", **p.document(p.ended))
        self.on_progress()
