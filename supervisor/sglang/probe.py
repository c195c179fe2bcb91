"""The decode probe: a real multi-token generation, judged strictly.

SGLang's /health submits a 1-token request and answers 200 as soon as any output arrives, so it
exercises prefill only, never the decode loop, CUDA graphs or the EAGLE draft+verify path. The
incident server passed /health and died on its first decode (docs/sglang.md). Readiness and
liveness here therefore ask for `max_tokens` tokens and check what came back.

`judge()` is pure and total: arbitrary bytes in, a verdict out, never an exception.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import httpx

from supervisor import untrusted
from supervisor.config import ProbeConfig
from supervisor.sglang import endpoints
from supervisor.sglang.logscan import OWN_RID_MARK

_T = TypeVar("_T")
# Present in meta_info only when speculative verification ran (docs/sglang.md).
SPEC_VERIFY_KEY = "spec_verify_ct"
# Every `reason` a failed probe can carry (the label of kimi_serve_probe_failures_total).
FAILURE_REASONS = (
    "connect",
    "connection_lost",
    "timeout",
    "http_status",
    "malformed",
    "too_few_tokens",
    "no_speculation",
    "unexpected_text",
)


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    # Label for kimi_serve_probe_failures_total{reason}; "ok" when ok.
    reason: str
    error: str | None
    latency_s: float
    completion_tokens: int | None = None
    spec_verify_ct: int | None = None
    text: str | None = None
    # The server is up but not serving yet (connection refused, 503 while starting): before
    # ready this is "try again", not "broken".
    not_up: bool = False
    meta: Mapping[str, Any] = field(default_factory=dict)
    rid: str | None = None  # the request id the probe sent (SGLang's `rid`)
    # A timed-out probe is aborted inside SGLang (POST /abort_request): True when SGLang took
    # the abort, False when it could not be sent, None when nothing needed aborting.
    aborted: bool | None = None

    def to_status(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("meta")
        return d


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str
    error: str | None = None
    completion_tokens: int | None = None
    spec_verify_ct: int | None = None
    text: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)


def request_for(cfg: ProbeConfig, rid: str | None = None) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of the probe request. Temperature 0: the answer is reproducible.

    `rid`: SGLang's request id (GenerateReqInput.rid and the chat request's `rid`, 0.5.23:
    docs/sglang.md), so a probe that times out can be aborted by that id.
    """
    extra: dict[str, Any] = {} if rid is None else {"rid": rid}
    if cfg.endpoint == "chat":
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": cfg.prompt}],
            "max_tokens": cfg.max_tokens,
            "temperature": 0,
            "stream": False,
            **extra,
        }
    return "/generate", {
        "text": cfg.prompt,
        "sampling_params": {"max_new_tokens": cfg.max_tokens, "temperature": 0},
        "stream": False,
        **extra,
    }


def new_rid(kind: str = "probe") -> str:
    """A request id no client of SGLang would send: recognisable in SGLang's own logs."""
    return f"{OWN_RID_MARK}{kind}-{uuid.uuid4().hex[:16]}"


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _finish_type(value: object) -> str | None:
    # /generate gives {"type": "length", "length": N} or {"type": "stop", "matched": ...};
    # the OpenAI schema gives a plain string.
    if isinstance(value, dict):
        t = value.get("type")
        return t if isinstance(t, str) else None
    return value if isinstance(value, str) else None


def _fail(reason: str, error: str, **kw: Any) -> Verdict:
    return Verdict(ok=False, reason=reason, error=error, **kw)


def judge(
    endpoint: str,
    status: int,
    body: bytes,
    cfg: ProbeConfig,
    speculative: bool,
) -> Verdict:
    if status != 200:
        snippet = body[:200].decode("utf-8", "replace").strip()
        return _fail("http_status", f"HTTP {status}: {snippet}" if snippet else f"HTTP {status}")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return _fail("malformed", "the answer is not JSON")
    if not isinstance(doc, dict):
        return _fail("malformed", f"expected a JSON object, got {type(doc).__name__}")

    meta: Mapping[str, Any] = {}
    if endpoint == "chat":
        choices = doc.get("choices")
        usage = doc.get("usage")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return _fail("malformed", "no choices in the chat completion")
        if not isinstance(usage, dict):
            return _fail("malformed", "no usage in the chat completion")
        choice = choices[0]
        message = choice.get("message")
        if not isinstance(message, dict):
            return _fail("malformed", "choices[0].message is missing")
        # With the kimi_k2 reasoning parser a short answer can land entirely in
        # reasoning_content; the token count is what proves decoding ran.
        parts = [message.get("content"), message.get("reasoning_content")]
        text = "".join(p for p in parts if isinstance(p, str))
        tokens = _int(usage.get("completion_tokens"))
        finish = _finish_type(choice.get("finish_reason"))
        verify_ct: int | None = None
    else:
        meta_raw = doc.get("meta_info")
        if not isinstance(meta_raw, dict):
            return _fail("malformed", "meta_info is missing from the /generate answer")
        meta = meta_raw
        raw_text = doc.get("text")
        if not isinstance(raw_text, str):
            return _fail("malformed", "text is missing from the /generate answer")
        text = raw_text
        tokens = _int(meta.get("completion_tokens"))
        finish = _finish_type(meta.get("finish_reason"))
        verify_ct = _int(meta.get(SPEC_VERIFY_KEY))

    if tokens is None:
        return _fail("malformed", "completion_tokens is missing or not a number", text=text)
    common: dict[str, Any] = {
        "completion_tokens": tokens,
        "spec_verify_ct": verify_ct,
        "text": text[:200],
        "meta": meta,
    }
    # All N tokens, or an early end the server chose on purpose (EOS / stop string) after more
    # than the single token /health would have produced.
    if tokens != cfg.max_tokens and not (finish == "stop" and 2 <= tokens < cfg.max_tokens):
        return _fail(
            "too_few_tokens",
            f"generated {tokens} of {cfg.max_tokens} tokens (finish_reason {finish!r})",
            **common,
        )
    if speculative and endpoint == "generate" and not (verify_ct and verify_ct > 0):
        # SGLang adds the spec_* keys to meta_info only when verification ran
        # (managers/tokenizer_manager.py:3149-3172, 0.5.23): absent means none ran, not 0.
        seen = (
            "the answer has no spec_verify_ct: no speculative verification ran"
            if SPEC_VERIFY_KEY not in meta
            else f"spec_verify_ct is {meta.get(SPEC_VERIFY_KEY)!r}"
        )
        return _fail(
            "no_speculation",
            f"speculative decoding is configured but {seen}: "
            "the EAGLE draft+verify path did not run",
            **common,
        )
    if cfg.expect_regex is not None and not re.search(cfg.expect_regex, text):
        return _fail(
            "unexpected_text",
            f"the answer {text[:80]!r} does not match expect_regex {cfg.expect_regex!r}",
            **common,
        )
    return Verdict(ok=True, reason="ok", **common)


async def probe(
    client: httpx.AsyncClient,
    base_url: str,
    cfg: ProbeConfig,
    speculative: bool,
    timeout: float | None = None,
    clock: Any = time.monotonic,
    rid: str | None = None,
) -> ProbeResult:
    """One decode probe. Never raises (except cancellation); never outlives `timeout` by more
    than the abort of a timed-out probe (endpoints.ABORT_TIMEOUT_S, and never longer than the
    probe's own timeout: a frozen SGLang answers neither, and detection must not wait on it).

    With `rid`, the request carries it and a probe that timed out is aborted inside SGLang.
    """
    result = await _probe(client, base_url, cfg, speculative, timeout, clock, rid)
    if rid is None:
        return result
    if result.reason == "timeout":
        bound = (
            endpoints.ABORT_TIMEOUT_S
            if timeout is None
            else min(endpoints.ABORT_TIMEOUT_S, timeout)
        )
        return dataclasses.replace(
            result, rid=rid, aborted=await endpoints.abort(client, base_url, rid, bound)
        )
    return dataclasses.replace(result, rid=rid)


async def _probe(
    client: httpx.AsyncClient,
    base_url: str,
    cfg: ProbeConfig,
    speculative: bool,
    timeout: float | None,
    clock: Any,
    rid: str | None,
) -> ProbeResult:
    path, body = request_for(cfg, rid)
    limit = cfg.timeout if timeout is None else timeout
    start = clock()
    try:
        status, raw = await endpoints.post_generate(client, base_url, path, body, limit)
    except TimeoutError:
        return ProbeResult(False, "timeout", f"no answer within {limit:g}s", clock() - start)
    except httpx.ConnectError as exc:
        return ProbeResult(False, "connect", f"cannot connect: {exc}", clock() - start, not_up=True)
    except httpx.TimeoutException:
        return ProbeResult(False, "timeout", f"no answer within {limit:g}s", clock() - start)
    except untrusted.BadAnswer as exc:  # over endpoints.MAX_ANSWER_BYTES, or encoded
        return ProbeResult(False, "malformed", str(exc), clock() - start)
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        return ProbeResult(False, "connect", f"bad URL {base_url!r}: {exc}", clock() - start)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        # RemoteProtocolError included: the incident server dropped the connection as it died.
        msg = str(exc) or type(exc).__name__
        return ProbeResult(False, "connection_lost", msg, clock() - start)
    except Exception as exc:  # e.g. an ExceptionGroup from the transport: still a verdict
        return ProbeResult(False, "connect", f"{type(exc).__name__}: {exc}", clock() - start)
    latency = clock() - start
    if status == 503:
        # SGLang answers 503 while it is still starting (or draining).
        return ProbeResult(False, "http_status", "HTTP 503: not serving yet", latency, not_up=True)
    v = judge(cfg.endpoint, status, raw, cfg, speculative)
    return ProbeResult(
        ok=v.ok,
        reason=v.reason,
        error=v.error,
        latency_s=latency,
        completion_tokens=v.completion_tokens,
        spec_verify_ct=v.spec_verify_ct,
        text=v.text,
        meta=v.meta,
    )


class ProbeGate:
    """At most one probe in flight against one SGLang: a probe asked for while another runs
    waits for it (each is bounded by its timeout plus the abort), so probes never stack up
    inside SGLang even when the machine's timers race a slow answer."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self.max_in_flight = 0  # the most seen at once (tests; must stay 1)
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def probe(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        cfg: ProbeConfig,
        speculative: bool,
        timeout: float | None = None,
        kind: str = "probe",
    ) -> ProbeResult:
        """One probe with a fresh `rid`, aborted inside SGLang if it times out."""
        async with self._lock:
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            try:
                return await probe(
                    client, base_url, cfg, speculative, timeout=timeout, rid=new_rid(kind)
                )
            finally:
                self._in_flight -= 1

    async def exclusive(self, fn: Callable[[], Awaitable[_T]]) -> _T:
        """Another request of the probe's kind (the canary) under the same one-in-flight rule."""
        async with self._lock:
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            try:
                return await fn()
            finally:
                self._in_flight -= 1


@dataclass(frozen=True)
class Progress:
    """SGLang's own counters, read from its /metrics (needs --enable-metrics).

    `realtime_tokens` is `sglang:realtime_tokens_total` summed over its modes (decode,
    prefill_compute, prefill_cache): the scheduler adds to it on every batch
    (`managers/scheduler_components/metrics_reporter.py:810,912`, SGLang 0.5.23).
    `generation_tokens` (`sglang:generation_tokens_total`) moves only when a request finishes,
    by its whole count (`managers/tokenizer_manager.py:3261`): under long generations it stays
    flat for minutes, so it is read only where the realtime counter does not exist (older
    releases, the stand-in). None means "this server does not export it".
    """

    generation_tokens: float | None
    running_requests: float | None
    realtime_tokens: float | None = None
    queued_requests: float | None = None
    # The decode part of realtime_tokens (mode="decode"); the rest is prefill.
    realtime_decode: float | None = None

    @property
    def tokens(self) -> float | None:
        return self.realtime_tokens if self.realtime_tokens is not None else self.generation_tokens

    @property
    def has_work(self) -> bool | None:
        """Requests running or queued; None when the server exports neither gauge."""
        if self.running_requests is None and self.queued_requests is None:
            return None
        return (self.running_requests or 0.0) + (self.queued_requests or 0.0) > 0


def parse_progress(text: str) -> Progress | None:
    """The counters busy detection reads, or None when the text holds none of them."""
    samples = endpoints.parse_metrics(text)
    return None if samples is None else progress_of(samples)


def progress_of(samples: endpoints.Samples) -> Progress | None:
    """`parse_progress` of samples already parsed."""
    realtime = endpoints.total(samples, "sglang:realtime_tokens_total")
    generation = endpoints.total(samples, "sglang:generation_tokens_total")
    if realtime is None and generation is None:
        return None
    decode = endpoints.total(samples, "sglang:realtime_tokens_total", mode="decode")
    if realtime is not None and decode is None:
        decode = 0.0
    running = endpoints.total(samples, "sglang:num_running_reqs")
    queued = endpoints.total(samples, "sglang:num_queue_reqs")
    return Progress(generation, running, realtime, queued, decode)


async def read_progress(
    client: httpx.AsyncClient, base_url: str, timeout: float = 2.0
) -> Progress | None:
    samples = await endpoints.fetch_samples(client, base_url, timeout)
    return None if samples is None else progress_of(samples)


# What the probe itself adds to the realtime counter besides its generated tokens: its prompt,
# counted once per probe (prefill_compute, or prefill_cache once the prefix is cached). The
# default prompt is 21 bytes, 32 tokens at most with a chat template around it. Too large an
# allowance hides a slow-but-busy server (a CPU decodes ~30-250 tokens/s); too small calls a
# server busy on the probe's own prefill. `prompt_token_bound()` gives the exact bound for a
# configured prompt.
PROBE_PROMPT_ALLOWANCE = 32
_CHAT_TEMPLATE_TOKENS = 32


def prompt_token_bound(cfg: ProbeConfig) -> int:
    """An upper bound on the probe prompt's token count: byte-level tokenizers never produce
    more tokens than bytes; a chat template adds its role markers."""
    template = _CHAT_TEMPLATE_TOKENS if cfg.endpoint == "chat" else 0
    return len(cfg.prompt.encode("utf-8")) + template


def _tokens_beyond_own(
    before: Progress, after: Progress, own_tokens: int, prompt_tokens: int
) -> bool | None:
    """Whether the scheduler processed tokens the probe cannot account for; None if unknown.

    With the realtime counter each mode is held against what the probe can add to it: its
    generated tokens to decode, its prompt to prefill. Else the generation counter (it counts
    the probe's tokens only if the probe finished, which a timed-out probe did not).
    """
    if before.realtime_tokens is not None and after.realtime_tokens is not None:
        decode = (after.realtime_decode or 0.0) - (before.realtime_decode or 0.0)
        prefill = (after.realtime_tokens - before.realtime_tokens) - decode
        return decode > own_tokens or prefill > prompt_tokens
    if before.generation_tokens is not None and after.generation_tokens is not None:
        return after.generation_tokens - before.generation_tokens > own_tokens
    return None


def is_busy(
    result: ProbeResult,
    before: Progress | None,
    after: Progress | None,
    own_tokens: int,
    prompt_tokens: int | None = None,
) -> bool:
    """A probe that timed out while SGLang kept working for others: loaded, not hung.

    Working = the scheduler processed more tokens than the probe itself could account for
    (`own_tokens` generated; with the realtime counter also its prompt, `prompt_tokens`, by
    default PROBE_PROMPT_ALLOWANCE) *and* requests were running or queued at one of the two
    reads. A hung scheduler leaves its gauges above 0 but its counter flat; an idle one has
    neither. A wrong answer is never excused as busy.
    """
    if result.reason != "timeout" or before is None or after is None:
        return False
    prompt = PROBE_PROMPT_ALLOWANCE if prompt_tokens is None else prompt_tokens
    if not _tokens_beyond_own(before, after, own_tokens, prompt):
        return False
    work = [w for w in (before.has_work, after.has_work) if w is not None]
    # No gauges at all (an exporter without them): the counter alone decides.
    return not work or any(work)


def server_url(host: str, port: int) -> str:
    """http://host:port for a server bound to `host` (a wildcard bind is reached on loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
