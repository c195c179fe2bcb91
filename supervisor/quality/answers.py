"""Serving quality verdicts on one answer: the canary's answer as SGLang sends it, its
comparison with the golden, the known answers, the states and degraded reasons. Pure and total:
arbitrary input in, a verdict out, no I/O. supervisor.quality re-exports it with the watches.

docs/quality.md says why each rule is what it is and what was measured on the real server.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from supervisor import untrusted

# Degraded reasons (kimi_serve_quality_degraded{reason}), in the order /status lists them.
CANARY_MISMATCH = "canary_mismatch"
SPEC_COLLAPSE = "spec_collapse"
SLOW_DECODE = "slow_decode"
NO_CUDA_GRAPH = "no_cuda_graph"
DEGRADED_REASONS = (CANARY_MISMATCH, SPEC_COLLAPSE, SLOW_DECODE, NO_CUDA_GRAPH)

# Canary states (/status.quality.canary.state).
LEARNED = "learned"
MATCHED = "matched"
MISMATCH = "mismatch"
DISABLED = "disabled"
UNKNOWN = "unknown"

# A golden token is compared only while the golden's own top-1 led its top-2 by at least this
# many nats (a probability ratio of e^1.5 = 4.5). Jitter of the serving stack (a radix-cache
# hit, another batch composition, tp reductions, bf16 rounding) moves logits by hundredths to a
# few tenths of a nat; it can swap two near-tied tokens, never a token that leads by 1.5. After
# the first near tie the continuation may legitimately differ, so nothing after it is compared
# (docs/quality.md, "The canary").
MARGIN_FLOOR = 1.5
# A golden that checks fewer tokens than this cannot tell a right model from a wrong one.
MIN_CHECKED = 2


@dataclass(frozen=True)
class Answer:
    """One greedy canary answer: its token ids, each position's top-1 - top-2 logprob margin
    (None where SGLang gave no top-2), the text, and the decode speed it was served at."""

    text: str
    tokens: tuple[int, ...]
    margins: tuple[float | None, ...]
    top2: tuple[int | None, ...] = ()  # the runner-up token at each position
    tokens_per_second: float | None = None
    server_measured: bool = False  # tokens_per_second is SGLang's own decode_throughput
    cached_tokens: int | None = None
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "tokens": list(self.tokens),
            "margins": list(self.margins),
            "top2": list(self.top2),
            "tokens_per_second": self.tokens_per_second,
            "server_measured": self.server_measured,
        }

    @staticmethod
    def from_json(doc: object) -> Answer | None:
        """A stored answer, or None if `doc` is not one (a damaged file is no golden)."""
        if not isinstance(doc, dict):
            return None
        text, tokens = doc.get("text"), doc.get("tokens")
        margins, top2 = doc.get("margins"), doc.get("top2", [])
        if not isinstance(text, str) or not isinstance(tokens, list):
            return None
        if not isinstance(margins, list) or len(margins) != len(tokens):
            return None
        if not isinstance(top2, list):
            return None
        if not all(_is_int(t) for t in tokens):
            return None
        if not all(m is None or _finite(m) for m in margins):
            return None
        tps = _num(doc.get("tokens_per_second"))
        return Answer(
            text=text,
            tokens=tuple(int(t) for t in tokens),
            margins=tuple(None if m is None else float(m) for m in margins),
            top2=tuple(int(t) if _is_int(t) else None for t in top2),
            tokens_per_second=tps,
            server_measured=doc.get("server_measured") is True,
        )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _num(v: object) -> float | None:
    """A finite number as float, else None."""
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _whole(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _pair(entry: object) -> tuple[float, int] | None:
    """SGLang's logprob entry [logprob, token_id, text|null] -> (logprob, token_id)."""
    if not isinstance(entry, list | tuple) or len(entry) < 2:
        return None
    lp, tid = entry[0], entry[1]
    if not _is_int(tid):
        return None
    if lp is None or not _finite(lp):
        return (-math.inf, int(tid))
    return (float(lp), int(tid))


def parse_answer(body: bytes, elapsed_s: float | None = None) -> Answer | str:
    """The /generate answer of a canary request (return_logprob, top_logprobs_num 2), or why it
    is not one. `elapsed_s`: the request's wall time, for the measured speed without
    --enable-metrics."""
    try:
        # untrusted.loads: depth, NaN/Infinity and integer length refused before any field is read.
        doc = untrusted.loads(body)
    except ValueError:
        return "the answer is not JSON"
    if isinstance(doc, list) and len(doc) == 1:
        doc = doc[0]
    if not isinstance(doc, dict):
        return "expected a JSON object"
    text, meta = doc.get("text"), doc.get("meta_info")
    if not isinstance(text, str) or not isinstance(meta, dict):
        return "text or meta_info is missing from the /generate answer"
    out = meta.get("output_token_logprobs")
    if not isinstance(out, list) or not out:
        return "meta_info.output_token_logprobs is missing (return_logprob ignored?)"
    tops = meta.get("output_top_logprobs")
    tokens: list[int] = []
    margins: list[float | None] = []
    top2: list[int | None] = []
    for i, entry in enumerate(out):
        chosen = _pair(entry)
        if chosen is None:
            return f"output_token_logprobs[{i}] is not [logprob, token_id, text]"
        tokens.append(chosen[1])
        margin: float | None = None
        runner: int | None = None
        if isinstance(tops, list) and i < len(tops) and isinstance(tops[i], list):
            ranked = sorted(
                (p for p in (_pair(e) for e in tops[i]) if p is not None),
                key=lambda p: -p[0],
            )
            others = [p for p in ranked if p[1] != chosen[1]]
            if ranked and others:
                best = max(chosen[0], ranked[0][0])
                margin = best - others[0][0]
                runner = others[0][1]
        margins.append(None if margin is None or not math.isfinite(margin) else margin)
        top2.append(runner)
    cached = _whole(meta.get("cached_tokens"))
    return Answer(
        text=text,
        tokens=tuple(tokens),
        margins=tuple(margins),
        top2=tuple(top2),
        tokens_per_second=decode_speed(meta, elapsed_s),
        server_measured=_finite(meta.get("decode_throughput")),
        cached_tokens=cached,
        meta=meta,
    )


def decode_speed(meta: Mapping[str, Any], elapsed_s: float | None) -> float | None:
    """Single-stream decode tokens/s: SGLang's own `decode_throughput` (--enable-metrics:
    observability/req_time_stats.py:500-532, 0.5.23), else completion tokens over the request's
    wall time (a lower bound: it includes the prefill)."""
    tput = _num(meta.get("decode_throughput"))
    if tput is not None and tput > 0:
        return tput
    tokens = _whole(meta.get("completion_tokens"))
    if tokens is not None and tokens > 1 and elapsed_s is not None and elapsed_s > 0:
        return float(tokens) / elapsed_s
    return None


def checked_prefix(golden: Answer, floor: float = MARGIN_FLOOR) -> int:
    """How many leading golden tokens are compared: up to the first position whose margin was
    below `floor` (or unknown) when the golden was recorded."""
    for i, m in enumerate(golden.margins):
        if m is None or m < floor:
            return i
    return len(golden.tokens)


@dataclass(frozen=True)
class Comparison:
    match: bool
    checked: int  # golden tokens compared
    first_diff: int | None  # the first compared position that differs
    weak: bool  # too few confident tokens to tell anything (checked < MIN_CHECKED)

    def detail(self, golden: Answer, got: Answer) -> str:
        if self.match:
            return f"{self.checked} confident tokens match"
        return (
            f"token {self.first_diff} of {self.checked} confident ones differs: "
            f"expected {golden.text!r}, got {got.text!r}"
        )


def compare(golden: Answer, got: Answer, floor: float = MARGIN_FLOOR) -> Comparison:
    """The canary verdict, walking the golden position by position while the answer follows it:
    where the golden was confident (margin >= `floor`) its token must come back; where it was a
    near tie, the answer's token must be one of the golden's two candidates there (a swap of
    the tie is jitter; a third token is not). Once the answer takes the runner-up, the
    continuation may legitimately differ and nothing after it is compared. While the answer
    keeps the golden's own tokens the context is the same, so jitter cannot flip a confident
    token later on either."""
    k = checked_prefix(golden, floor)
    # A golden with few confident tokens (a flat, random model; a prompt it cannot continue)
    # is reported as weak: it tells less, but the same rules hold. Other weights or garbage
    # pick any token of the vocabulary at a tie; jitter would need a three-way tie.
    weak = k < MIN_CHECKED
    for i, token in enumerate(golden.tokens):
        if i >= len(got.tokens):
            return Comparison(False, k, i, weak) if i < k else Comparison(True, k, None, weak)
        if got.tokens[i] == token:
            continue
        margin = golden.margins[i] if i < len(golden.margins) else None
        runner = golden.top2[i] if i < len(golden.top2) else None
        if margin is not None and margin >= floor:
            return Comparison(False, k, i, weak)
        if runner is None or got.tokens[i] == runner:
            return Comparison(True, k, None, weak)  # the tie swapped (or nothing to tell)
        return Comparison(False, k, i, weak)
    return Comparison(True, k, None, weak)


# ------------------------------------------------------------------------- known answers


@dataclass(frozen=True)
class KnownResult:
    """One of `quality.known_answers` asked of a launch: the greedy answer must begin with
    `expect` (leading whitespace ignored on both). `got` is None when no answer came."""

    prompt: str
    expect: str
    got: str | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.got is not None and holds(self.expect, self.got)

    def detail(self) -> str:
        if self.got is None:
            return f"known answer to {self.prompt!r}: {self.error or 'no answer'}"
        verdict = "holds" if self.ok else "fails"
        return (
            f"known answer to {self.prompt!r} {verdict}: expected {self.expect!r}, got {self.got!r}"
        )

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "expect": self.expect, "got": self.got, "ok": self.ok}

    @staticmethod
    def from_json(doc: object) -> KnownResult | None:
        if not isinstance(doc, dict):
            return None
        prompt, expect, got = doc.get("prompt"), doc.get("expect"), doc.get("got")
        if not isinstance(prompt, str) or not isinstance(expect, str):
            return None
        return KnownResult(prompt, expect, got if isinstance(got, str) else None)


def holds(expect: str, got: str) -> bool:
    """Whether an answer begins with the expected text, whitespace before either ignored."""
    return got.lstrip().startswith(expect.lstrip())


def known_tokens(expect: str) -> int:
    """Tokens to ask for a known answer: enough to hold `expect` (a token is at least one byte
    of it, bar the whitespace before it) and a few more, at most 256."""
    return min(256, max(8, len(expect.strip().encode()) + 4))
