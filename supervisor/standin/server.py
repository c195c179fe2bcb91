"""The stand-in's main process: load, bind, warm up, serve, drain, exit.

The order is SGLang's (sglang/srt/entrypoints/http_server.py, launch_server): children are
spawned and the model "loads" before anything listens; the HTTP port is bound only after
loading; SGLang's own warmup request runs; then `The server is fired up and ready to roll!`.

Signal handlers only post an event; one loop dispatches events by name. Every exit goes
through `_exit`, which kills the children and leaves at once, without aiohttp's graceful
shutdown (it would wait for hung handlers): connections close with the process, as they do
when SGLang's kill_process_tree SIGKILLs its own tree.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time
from collections.abc import Sequence
from multiprocessing import resource_tracker
from typing import NoReturn

from aiohttp import web

from supervisor.standin import faults as f
from supervisor.standin import tracebacks
from supervisor.standin.api import CONTEXT_LEN, MAX_TOTAL_NUM_TOKENS, VERSION, Api
from supervisor.standin.args import ServerArgs, parse_args
from supervisor.standin.children import DETOKENIZER, ChildOptions, Children, Death
from supervisor.standin.engine import Engine, Status
from supervisor.standin.faults import Settings, SettingsError
from supervisor.standin.logs import Log
from supervisor.standin.nodes import Rendezvous, dummy_health_app

READY_LINE = "The server is fired up and ready to roll!"
SHARDS = 64
_WATCH_SECONDS = 0.2
# SGLang's sigterm_watchdog reports the remaining requests every 5 s while it drains.
_DRAIN_REPORT_SECONDS = 5.0
_DRAIN_POLL_SECONDS = 0.05
# tokenizer_manager.py:3480-3485: "Sleeping 5 seconds before crash diagnostics".
_CRASH_DIAGNOSTICS_SECONDS = 5.0

SIGTERM, SIGINT, CHILD_DIED, EXIT_AFTER, FATAL = (
    "SIGTERM",
    "SIGINT",
    "child-died",
    "exit-after",
    "fatal",
)


class Server:
    def __init__(self, args: ServerArgs, settings: Settings, log: Log) -> None:
        self.args = args.resolved()
        self._max_running_given = args.max_running_requests is not None
        self.settings = settings
        self.log = log
        self.children = Children()
        self.engine = Engine(self.args, settings, log, on_fatal=lambda: self._post(FATAL))
        self._events: collections.deque[str] = collections.deque()
        self._wake = asyncio.Event()
        self._deaths: list[Death] = []
        self._last_report = 0.0
        # Held here: the event loop keeps only weak references to tasks.
        self._watcher: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.follower = self.args.nnodes > 1 and self.args.node_rank >= 1
        self.rendezvous = (
            Rendezvous(
                self.args.dist_init_addr or "127.0.0.1:5000",
                self.args.nnodes,
                self.args.node_rank,
                self._peer_lost,
            )
            if self.args.nnodes > 1
            else None
        )

    # -- events ---------------------------------------------------------------------------

    def _post(self, event: str) -> None:
        self._events.append(event)
        self._wake.set()

    async def _pause(self, seconds: float | None) -> str | None:
        """The next event, or None once `seconds` have passed without one."""
        if not self._events:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), seconds)
            except TimeoutError:
                return None
        return self._events.popleft() if self._events else None

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        if self.settings.has(f.IGNORE_SIGTERM):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            loop.add_signal_handler(signal.SIGTERM, self._post, SIGTERM)
        loop.add_signal_handler(signal.SIGINT, self._post, SIGINT)

    async def _watch_children(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_SECONDS)
            deaths = self.children.newly_dead()
            if deaths:
                self._deaths.extend(deaths)
                self._post(CHILD_DIED)

    def _peer_lost(self) -> None:
        # NCCL: the survivors block in their next collective; nothing exits, nothing logs
        # until SGLang's own watchdog (300 s), which the stand-in does not model.
        self.engine.peer_lost = True

    def _exit(self, code: int) -> NoReturn:
        self.children.kill_all()
        os._exit(code)

    def _kill_tree(self) -> NoReturn:
        """kill_process_tree(os.getpid()): the children, then itself, by SIGKILL (exit 137)."""
        self.log.info(tracebacks.kill_process_tree(os.getpid()))
        self.children.kill_all()
        os.kill(os.getpid(), signal.SIGKILL)
        os._exit(137)  # not reached

    # -- start-up -------------------------------------------------------------------------

    async def run(self) -> NoReturn:
        self._install_signals()
        self._log_start()
        # Python's multiprocessing starts its resource tracker with SGLang's first child; it
        # shows as `python -c from multiprocessing.resource_tracker import main;main(N)`.
        resource_tracker.ensure_running()
        self.children.spawn(
            self.args.tp_size,
            ChildOptions(
                orphan=self.settings.has(f.ORPHANS),
                ignore_sigterm=self.settings.has(f.IGNORE_SIGTERM),
                lifetime=self.settings.orphan_lifetime,
            ),
            detokenizer=not self.follower,
        )
        self._watcher = asyncio.create_task(self._watch_children())
        if self.settings.has(f.LOG_FLOOD):
            self.log.flood(self.settings.flood_lines)
            if self.settings.flood_only:
                self._exit(0)
        await self._load()
        if self.follower:
            await self._serve_follower()
        self._runner = await self._bind()
        await self._warmup()
        if self.settings.has(f.EXIT_AFTER):
            asyncio.get_running_loop().call_later(self.settings.exit_after, self._post, EXIT_AFTER)
        await self._serve()

    def _log_start(self) -> None:
        faults = ", ".join(sorted(self.settings.faults)) or "none"
        self.log.info(
            f"SGLang stand-in {VERSION} (launch {self.settings.launch}; faults: {faults})"
        )
        shown = ", ".join(f"{k}={v!r}" for k, v in self.args.as_dict().items())
        self.log.info(f"server_args=ServerArgs({shown})")
        if self.args.speculative:
            if not self._max_running_given:
                self.log.warning(
                    "server_args.py:1913",
                    "Max running requests is reset to 48 for speculative decoding. You can "
                    "override this by explicitly setting --max-running-requests.",
                )
            # 0.5.23 says nothing when the overlap schedule is on (the default).
            if self.args.disable_overlap_schedule:
                self.log.warning(
                    "server_args.py:1925",
                    "Non-overlap (synchronous) spec v2 is used for eagle/eagle3/standalone "
                    "speculative decoding.",
                )

    def _startup_event(self, event: str | None) -> None:
        """Handle an event that arrives before the server is ready."""
        if event in (SIGTERM, SIGINT):
            self._exit(0)
        if event == CHILD_DIED:
            # engine._launch_subprocesses: the pipe from a dead scheduler hits EOF.
            for death in self._deaths:
                rank = death.role.removeprefix("sglang::scheduler").removeprefix("_TP") or "0"
                what = "Detokenizer" if death.role == DETOKENIZER else f"Rank {rank} scheduler"
                self.log.info(f"{what} is dead. Please check if there are relevant logs.")
                self.log.info(f"Exit code: {death.returncode}")
            self._exit(1)

    async def _at(self, deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0:
            self._startup_event(await self._pause(left))

    def _progress(self, done: int, started: float) -> str:
        elapsed = time.monotonic() - started
        rate = done / elapsed if elapsed > 0 else 0.0
        left = (SHARDS - done) / rate if rate > 0 else 0.0
        return (
            f"Loading safetensors checkpoint shards: {100 * done // SHARDS:3d}% Completed | "
            f"{done}/{SHARDS} [{_mmss(elapsed)}<{_mmss(left)}, {rate:.2f}it/s]"
        )

    async def _load(self) -> None:
        """The scheduler's loading log, spread over STANDIN_LOAD_SECONDS."""
        load, t0, tp = self.settings.load_seconds, time.monotonic(), self.log.tp

        async def until(frac: float) -> None:
            await self._at(t0 + frac * load)

        await until(0.02)
        for rank in range(self.args.tp_size):
            tp(rank, "Init torch distributed begin.")
        if self.rendezvous is not None:
            await self.rendezvous.meet()
            t0 = time.monotonic() - 0.02 * load  # the wait for the others is no load time
        await until(0.05)
        for rank in range(self.args.tp_size):
            tp(rank, "Init torch distributed ends. mem usage=0.00 GB")
        await until(0.08)
        tp(0, "Load weight begin. avail mem=139.24 GB")
        started = time.monotonic()
        for i in range(1, 9):
            await until(0.08 + 0.09 * i)
            tp(0, self._progress(i * SHARDS // 8, started))
            if i == 4 and self.settings.has(f.NEVER_READY):
                await self._load_forever(started, i * SHARDS // 8)
        if self.settings.has(f.CRASH_DURING_LOAD):
            tp(0, tracebacks.LOAD_CRASH)
            self.log.info(tracebacks.SIGQUIT_FROM_CHILD)
            self._exit(1)
        await until(0.82)
        tp(
            0,
            "Load weight end. type=DeepseekV3ForCausalLM, dtype=torch.bfloat16, "
            "avail mem=66.81 GB, mem usage=72.43 GB.",
        )
        await until(0.86)
        tp(0, f"KV Cache is allocated. #tokens: {MAX_TOTAL_NUM_TOKENS}, KV size: 41.17 GB")
        await until(0.88)
        tp(0, "Capture cuda graph begin. This can take up to several minutes. avail mem=24.95 GB")
        await until(0.99)
        tp(
            0,
            f"Capture cuda graph end. Time elapsed: {0.11 * load:.2f} s. mem usage=1.84 GB. "
            "avail mem=23.11 GB.",
        )
        await until(1.0)
        while not self.children.all_ready:
            self._startup_event(await self._pause(_WATCH_SECONDS / 4))
        self.log.info(
            f"max_total_num_tokens={MAX_TOTAL_NUM_TOKENS}, chunked_prefill_size=8192, "
            f"max_prefill_tokens=16384, "
            f"max_running_requests={self.args.max_running_requests}, "
            f"context_len={CONTEXT_LEN}, available_gpu_mem=23.11 GB"
        )

    async def _load_forever(self, started: float, done: int) -> NoReturn:
        """never-ready: keep loading at a normal load's pace, one shard short of the end."""
        interval = min(5.0, max(0.05, self.settings.load_seconds / 8))
        while True:
            await self._at(time.monotonic() + interval)
            done = min(done + 1, SHARDS - 1)
            self.log.tp(0, self._progress(done, started))

    async def _bind(self) -> web.AppRunner:
        host, port = self.args.host, self.args.port
        self.log.uvicorn(f"Started server process [{os.getpid()}]")
        self.log.uvicorn("Waiting for application startup.")
        self.log.uvicorn("Application startup complete.")
        runner = web.AppRunner(Api(self.engine).app(), handle_signals=False, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            # asyncio words it as uvicorn prints it: "[Errno 98] error while attempting to
            # bind on address ('127.0.0.1', 30000): address already in use".
            self.log.uvicorn_error(str(exc))
            self._exit(1)
        self.log.uvicorn(f"Uvicorn running on http://{host}:{port} (Press CTRL+C to quit)")
        return runner

    async def _warmup(self) -> None:
        """http_server._execute_server_warmup: /model_info, then an 8-token /generate.

        It runs inside the process: the stand-in's faults are for its clients, and the seed
        incident's server passed SGLang's warmup too.
        """
        await self._at(time.monotonic() + self.settings.warmup_seconds)
        self.log.access("127.0.0.1:40000", "GET", "/model_info", 200, "OK")
        with self.engine.request() as rid:
            await self.engine.decode(rid, "The capital city of France is", 6, 8, internal=True)
        self.log.access("127.0.0.1:40000", "POST", "/generate", 200, "OK")
        self._startup_event(await self._pause(0))
        self.engine.status = Status.UP
        self.log.info(READY_LINE)

    async def _serve_follower(self) -> NoReturn:
        """Rank >= 1: the dummy health server, then wait for the schedulers to exit. SIGTERM
        only logs: rank 0's ShutdownReq stops every rank (entrypoints/engine.py:1262-1272)."""
        runner = web.AppRunner(dummy_health_app(), handle_signals=False, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.args.host, self.args.port).start()
        except OSError as exc:
            self.log.uvicorn_error(str(exc))
            self._exit(1)
        self._runner = runner
        self.log.uvicorn(f"Uvicorn running on http://{self.args.host}:{self.args.port}")
        while True:
            event = await self._pause(None)
            if event == SIGTERM:
                self.log.info(
                    f"SIGTERM received on node_rank {self.args.node_rank}; waiting for the "
                    "rank-0 ShutdownReq broadcast to stop the schedulers."
                )
            elif event == SIGINT:
                self._exit(0)
            elif event == CHILD_DIED:
                self._deaths.clear()
                self._exit(1)  # block_until_scheduler_exits returned

    # -- serving --------------------------------------------------------------------------

    async def _serve(self) -> NoReturn:
        while True:
            event = await self._pause(_DRAIN_POLL_SECONDS if self.engine.draining else None)
            if event is not None:
                await self._dispatch(event)
            if self.engine.draining:
                self._drain_step()

    async def _dispatch(self, event: str) -> None:
        if event == SIGTERM and not self.engine.draining:
            # tokenizer_manager: /health answers 503 from now on, new requests are still
            # accepted, and the drain waits for every open request, with no time limit.
            self.log.info(
                "SIGTERM received. signum=None frame=None. Draining requests and shutting down..."
            )
            self.engine.draining = True
        elif event == SIGINT:
            self.log.uvicorn("Shutting down")
            self._exit(0)
        elif event == FATAL:
            await self._die_after_crash()
        elif event == EXIT_AFTER:
            self.log.info(
                f"RuntimeError: fault exit-after: exiting with code "
                f"{self.settings.exit_code} {self.settings.exit_after:g} s after ready"
            )
            self._exit(self.settings.exit_code)
        elif event == CHILD_DIED:
            crashed = [d for d in self._deaths if d.returncode != 0]
            self._deaths.clear()
            self.engine.scheduler_died()
            if crashed:
                # utils/watchdog.py:203-221: the subprocess watchdog SIGQUITs the main process.
                death = crashed[0]
                self.log.info(
                    tracebacks.subprocess_crashed(
                        _watchdog_name(death.role), death.pid, death.returncode
                    )
                )
                await self._sigquit(diagnostics=_CRASH_DIAGNOSTICS_SECONDS)

    def _drain_step(self) -> None:
        """tokenizer_manager.sigterm_watchdog, one turn."""
        remaining = sorted(self.engine.open_requests)
        if self.engine.status is Status.UNHEALTHY:
            self.log.info("Signal SIGTERM received while health check failed. Force exiting.")
            self._exit(0)
        if self.settings.force_shutdown:
            self.log.info("Signal SIGTERM received while force shutdown flag set. Force exiting.")
            self._exit(0)
        now = time.monotonic()
        if not remaining or now - self._last_report >= _DRAIN_REPORT_SECONDS:
            self._last_report = now
            self.log.info(
                f"Gracefully exiting... Remaining number of requests {len(remaining)}. "
                f"Remaining requests remaining_rids={remaining!r}."
            )
        if not remaining:
            self._exit(0)

    async def _die_after_crash(self) -> NoReturn:
        """A scheduler raised (run_scheduler_process, scheduler.py:6370-6380).

        With SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1 the scheduler SIGKILLs the whole process
        group at once: the main process dies by signal 9, with no crash-dump phase. Without it
        the scheduler SIGQUITs the main process, which on a GPU host spends about a minute on
        py-spy and CUDA coredump steps (STANDIN_CRASH_SLEEP_SECONDS) and then SIGKILLs its own
        tree; SIGTERM or SIGINT cut that short here.
        """
        if self.settings.killpg_on_scheduler_exception:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        await self._sigquit(diagnostics=self.settings.crash_sleep_seconds)

    async def _sigquit(self, diagnostics: float) -> NoReturn:
        """running_phase_sigquit_handler: dump, wait `diagnostics` seconds, kill the tree.

        Meanwhile nothing answers: SGLang's handler blocks its event loop in time.sleep.
        """
        self.log.info(tracebacks.SIGQUIT_RUNNING)
        self.log.info(tracebacks.CRASH_DIAGNOSTICS)
        deadline = time.monotonic() + diagnostics
        while (left := deadline - time.monotonic()) > 0:
            if await self._pause(left) in (SIGTERM, SIGINT):
                break
        if all(role == DETOKENIZER for role in self.children.alive()):
            self.log.info(tracebacks.NO_LIVE_SCHEDULERS)
        self._kill_tree()


def _watchdog_name(role: str) -> str:
    """engine.py:1312-1365: SubprocessWatchdog names its processes scheduler_<i>, detokenizer."""
    if role == DETOKENIZER:
        return "detokenizer"
    return f"scheduler_{role.removeprefix('sglang::scheduler').removeprefix('_TP') or '0'}"


def _mmss(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log = Log(tp_size=args.tp_size)
    try:
        launch = f.next_launch(os.environ.get("STANDIN_LAUNCH_COUNTER"))
        settings = f.from_environ(os.environ, launch)
    except (SettingsError, OSError) as exc:
        log.info(f"standin: {exc}")
        return 2
    asyncio.run(Server(args, settings, log).run())
