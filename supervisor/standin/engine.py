"""The stand-in's tokenizer manager and scheduler: request state, fake decoding, counters.

What it imitates (sglang/srt/managers/tokenizer_manager.py, scheduler.py):
- /health submits a 1-token request: prefill only, never the decode loop, CUDA graphs or
  the speculative path. So the health path ignores every decode fault; it only fails when the
  scheduler is gone (then it waits SGLANG_HEALTH_CHECK_TIMEOUT and answers 503).
- A decode produces exactly max_new_tokens (the stand-in has no EOS), so
  `completion_tokens == max_new_tokens` and `finish_reason` is "length".
- Counters as SGLang's move: the scheduler's `realtime_tokens_total{mode="prefill_compute"}`
  at each prefill and `{mode="decode"}` while tokens are produced (every batch); the tokenizer
  manager's `generation_tokens_total` only when a request finishes, by its whole token count
  (sglang/srt/observability/metrics_collector.py:1032 and :1860; tokenizer_manager.py:3261).
  A hung request keeps `num_running_reqs` up while every counter stands still; a long
  generation moves `realtime_tokens_total` and not `generation_tokens_total`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import math
import threading
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterator

from supervisor.standin import faults as f
from supervisor.standin import tracebacks
from supervisor.standin.args import ServerArgs
from supervisor.standin.faults import Settings
from supervisor.standin.logs import Log

# SGLang's TTFT histogram buckets (sglang/srt/metrics/collector.py, TokenizerMetricsCollector).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    25.0,
    30.0,
)
# The scheduler logs a decode line every `decode_log_interval` (40) steps.
DECODE_LOG_INTERVAL = 40
# An EOS id of the Kimi/DeepSeek tokenizer family, for `matched` on a stop.
EOS_TOKEN_ID = 163586
_STEP_SECONDS = 0.02
_VOCAB = 163840


class Status(enum.Enum):
    """tokenizer_manager.ServerStatus."""

    STARTING = "Starting"
    UP = "Up"
    UNHEALTHY = "UnHealthy"


class Outcome(enum.Enum):
    NORMAL = "normal"
    ZERO = "zero"
    ERROR = "error"
    HANG = "hang"
    SLOW = "slow"
    CRASH = "crash"


def decide(settings: Settings, decodes_before: int, max_new_tokens: int) -> Outcome:
    """What the next external decode request meets, given the faults in force."""
    if settings.has(f.SEED_INCIDENT) and max_new_tokens > 1:
        return Outcome.CRASH
    if settings.has(f.DECODE_500):
        return Outcome.ERROR
    if settings.has(f.DECODE_ZERO_TOKENS):
        return Outcome.ZERO
    if (
        settings.has(f.DECODE_HANG)
        and decodes_before >= settings.hang_after_decodes
        and max_new_tokens >= settings.hang_min_tokens
    ):
        return Outcome.HANG
    if settings.has(f.SLOW_DECODE) and decodes_before >= settings.slow_after_decodes:
        return Outcome.SLOW
    return Outcome.NORMAL


@dataclasses.dataclass(frozen=True)
class Spec:
    """Per-request speculative numbers as tokenizer_manager._calculate_spec_decoding_metrics
    reports them: accept_length = completion_tokens / verify_ct (bonus token included)."""

    verify_ct: int
    accept_length: float
    accept_rate: float
    accepted_tokens: int
    draft_tokens: int


def spec_for(completion_tokens: int, num_draft_tokens: int) -> Spec:
    # Each verify step lands up to 3 tokens (2 accepted drafts + the bonus token).
    per_verify = max(1, min(num_draft_tokens, 3))
    verify_ct = math.ceil(completion_tokens / per_verify)
    if verify_ct == 0:
        return Spec(0, 0.0, 0.0, 0, 0)
    accepted = completion_tokens - verify_ct
    drafts = verify_ct * max(0, num_draft_tokens - 1)
    return Spec(
        verify_ct=verify_ct,
        accept_length=completion_tokens / verify_ct,
        accept_rate=accepted / drafts if drafts else 0.0,
        accepted_tokens=accepted,
        draft_tokens=drafts,
    )


def completion_words(prompt: str, n: int) -> list[str]:
    """Deterministic output: the prompt's words, repeated."""
    words = prompt.split() or ["hello"]
    return [words[i % len(words)] for i in range(n)]


def token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % _VOCAB


@dataclasses.dataclass(frozen=True)
class Result:
    rid: str
    words: list[str]
    prompt_tokens: int
    e2e_latency: float
    spec: Spec | None
    stopped: bool  # finished on EOS (zero-token fault) rather than on length

    @property
    def completion_tokens(self) -> int:
        return len(self.words)


class DecodeError(RuntimeError):
    """The request fails with HTTP 500 (fault decode-500)."""


class Engine:
    def __init__(
        self, args: ServerArgs, settings: Settings, log: Log, on_fatal: Callable[[], None]
    ) -> None:
        self.args = args
        self.settings = settings
        self.log = log
        self._on_fatal = on_fatal
        self.status = Status.STARTING
        self.draining = False
        self.scheduler_dead = False
        # Multi-node: another node's processes died; every collective blocks (standin/nodes.py).
        self.peer_lost = False
        # tokenizer_manager.rid_to_state: requests accepted and not yet answered (what a
        # SIGTERM drain waits for), and the scheduler's running batch (num_running_reqs).
        self.open_requests: set[str] = set()
        self.running: set[str] = set()
        self._tasks: dict[str, asyncio.Task[object]] = {}  # rid -> the handler serving it
        self.decodes_started = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.realtime_prefill_tokens = 0
        self.realtime_decode_tokens = 0
        self.gen_throughput = 0.0
        self.spec_accept_length = 0.0
        self.spec_tokens_total = 0
        self.spec_verify_total = 0
        self.ttft_counts = [0] * len(TTFT_BUCKETS)
        self.ttft_count = 0
        self.ttft_sum = 0.0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    # -- health ---------------------------------------------------------------------------

    async def health(self) -> int:
        """http_server.health_generate: the status code /health answers with."""
        if self.draining:
            self.log.info("Health check request received during shutdown. Returning 503.")
            return 503
        if self.status is Status.STARTING:
            return 503
        if self.scheduler_dead:
            tic = time.time()
            await asyncio.sleep(self.settings.health_check_timeout)
            self.log.info(
                "Health check failed. Server couldn't get a response from detokenizer for last "
                f"{self.settings.health_check_timeout:g} seconds. tic start time: "
                f"{time.strftime('%H:%M:%S', time.localtime(tic))}. last_heartbeat time: "
                f"{time.strftime('%H:%M:%S', time.localtime(tic))}"
            )
            self.status = Status.UNHEALTHY
            return 503
        await asyncio.sleep(self.settings.seconds_per_token)  # one prefill step
        self.status = Status.UP
        return 200

    @property
    def ready(self) -> bool:
        return self.status is Status.UP and not self.draining

    # -- decoding -------------------------------------------------------------------------

    @contextlib.contextmanager
    def request(self, rid: object = None) -> Iterator[str]:
        """Register one HTTP request from arrival until its response has been sent.

        A client's own `rid` is kept (GenerateReqInput.rid), so /abort_request can name it.
        """
        rid = rid if isinstance(rid, str) and rid else uuid.uuid4().hex
        self.open_requests.add(rid)
        task = asyncio.current_task()
        if task is not None:
            self._tasks[rid] = task
        try:
            yield rid
        finally:
            self.open_requests.discard(rid)
            self._tasks.pop(rid, None)

    def abort(self, rid: str, abort_all: bool = False) -> None:
        """tokenizer_manager.abort_request: the request stops wherever it is (waiting, running
        or hung) and leaves the running batch; an unknown rid is ignored, as SGLang does."""
        for key, task in list(self._tasks.items()):
            if abort_all or key == rid:
                task.cancel()

    async def decode(
        self,
        rid: str,
        prompt: str,
        prompt_tokens: int,
        max_new_tokens: int,
        *,
        internal: bool = False,
        progress: Callable[[int], Awaitable[None]] | None = None,
    ) -> Result:
        """Generate for one request; raises DecodeError for an HTTP 500, never returns when
        the request hangs or the scheduler is gone."""
        outcome = (
            Outcome.NORMAL
            if internal
            else decide(self.settings, self.decodes_started, max_new_tokens)
        )
        if not internal:
            self.decodes_started += 1
        if outcome is Outcome.ERROR:
            raise DecodeError("CUDA error: an illegal memory access was encountered")
        if outcome is Outcome.CRASH and not self.scheduler_dead:
            self.scheduler_died()
            self.log.tp(0, tracebacks.SEED_INCIDENT)
            self._on_fatal()
        if self.scheduler_dead or self.peer_lost:
            await _forever()  # nothing is left to answer; the connection dies with the process
        n = 0 if outcome is Outcome.ZERO else max_new_tokens
        self.running.add(rid)
        start = time.monotonic()
        try:
            self.realtime_prefill_tokens += prompt_tokens
            self.log.tp(
                0,
                f"Prefill batch, #new-seq: 1, #new-token: {prompt_tokens}, #cached-token: 0, "
                f"token usage: 0.00, #running-req: {len(self.running) - 1}, #queue-req: 0",
            )
            if outcome is Outcome.HANG:
                await asyncio.to_thread(decode_step_hung)
            await self._produce(n, outcome is Outcome.SLOW, progress)
        finally:
            self.running.discard(rid)
        # The tokenizer manager counts a request when it finishes (tokenizer_manager.py:3261).
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += n
        spec = None
        if self.args.speculative:
            collapsed = self.settings.has(f.SPEC_COLLAPSE)
            spec = spec_for(n, 1 if collapsed else self.args.speculative_num_draft_tokens or 1)
            if spec.verify_ct:
                self.spec_accept_length = spec.accept_length
                self.spec_tokens_total += n
                self.spec_verify_total += spec.verify_ct
        words = completion_words(prompt, n)
        if self.settings.has(f.WRONG_ANSWER):
            words = [w[::-1] + "x" for w in words]  # other tokens, as wrong weights give
        return Result(
            rid=rid,
            words=words,
            prompt_tokens=prompt_tokens,
            e2e_latency=time.monotonic() - start,
            spec=spec,
            stopped=outcome is Outcome.ZERO,
        )

    def scheduler_died(self) -> None:
        """A scheduler or the detokenizer is gone: nothing answers any more."""
        self.scheduler_dead = True

    @property
    def avg_spec_accept_length(self) -> float | None:
        if not self.args.speculative:
            return None
        return self.spec_tokens_total / self.spec_verify_total if self.spec_verify_total else 0.0

    async def _produce(
        self, n: int, slow: bool, progress: Callable[[int], Awaitable[None]] | None = None
    ) -> None:
        """Produce the request's `n` tokens over its duration, moving the counters as it goes.

        Under slow-decode the request takes STANDIN_SLOW_DECODE_SECONDS while the batch around
        it (other clients, imitated) keeps producing a token every seconds_per_token: the
        server is busy, not dead.
        """
        spt = self.settings.seconds_per_token
        duration = self.settings.slow_decode_seconds if slow else n * spt
        counted_total = max(n, math.floor(duration / spt)) if slow and spt > 0 else n
        start = time.monotonic()
        own = counted = 0
        while own < n or counted < counted_total:
            if duration > 0:
                left = start + duration - time.monotonic()
                await asyncio.sleep(min(_STEP_SECONDS, max(0.0, left)))
            elapsed = time.monotonic() - start
            frac = 1.0 if duration <= 0 else min(1.0, elapsed / duration)
            if own == 0 and n and math.floor(frac * n) >= 1:
                self._observe_ttft(elapsed)
            was, own = own, n if frac >= 1.0 else math.floor(frac * n)
            if progress is not None and own > was and own < n:
                await progress(own)  # a stream's chunk (the last one comes with the result)
            due = counted_total if frac >= 1.0 else math.floor(frac * counted_total)
            self._count(due - counted)
            counted = due

    def _count(self, tokens: int) -> None:
        if tokens <= 0:
            return
        before = self.realtime_decode_tokens
        self.realtime_decode_tokens += tokens
        now = time.monotonic()
        self._recent.append((now, tokens))
        while self._recent and self._recent[0][0] < now - 1.0:
            self._recent.popleft()
        # Like SGLang's gauge, this is set while decoding and keeps its last value when idle.
        self.gen_throughput = float(sum(t for _, t in self._recent))
        if before // DECODE_LOG_INTERVAL != self.realtime_decode_tokens // DECODE_LOG_INTERVAL:
            self.log.tp(
                0,
                f"Decode batch, #running-req: {len(self.running)}, "
                f"#token: {self.realtime_decode_tokens}, token usage: 0.01, "
                f"cuda graph: {not self.settings.has(f.NO_CUDA_GRAPH)}, "
                f"gen throughput (token/s): {self.gen_throughput:.2f}, #queue-req: 0",
            )

    def _observe_ttft(self, seconds: float) -> None:
        self.ttft_count += 1
        self.ttft_sum += seconds
        for i, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_counts[i] += 1


def decode_step_hung() -> None:
    """A decode step that never returns, on a thread of its own as a stuck CUDA call would be:
    the HTTP loop stays up, and a py-spy dump shows this frame (tests look for its name)."""
    threading.Event().wait()


async def _forever() -> None:
    await asyncio.Event().wait()
