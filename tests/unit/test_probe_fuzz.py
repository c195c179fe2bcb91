"""`judge()` is total and strict: whatever comes back from the wire, it never raises, and it
says ok only for an answer that proves decoding ran.

The oracle below restates the rules from the contract (docs/sglang.md, "Decode probe")
without reusing the probe's helpers: an answer is valid when it is a JSON object of the right
schema, its completion token count is a whole number equal to max_tokens (or between 2 and
max_tokens with a deliberate stop), speculative /generate answers carry spec_verify_ct > 0, and
the text matches expect_regex. Each failure has one reason, checked in that order.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.config import ProbeConfig
from supervisor.sglang.probe import FAILURE_REASONS, Progress, judge, parse_progress

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CONFIGS = st.builds(
    ProbeConfig,
    endpoint=st.sampled_from(["generate", "chat"]),
    prompt=st.just("Say hello in one word"),
    max_tokens=st.sampled_from([2, 8, 10]),
    timeout=st.just(30.0),
    expect_regex=st.sampled_from([None, None, "(?i)hello", "^$", "x+"]),
)

# ------------------------------------------------------------------------------ the oracle


def _whole(value: object) -> int | None:
    """A token count: a JSON integer, or a float with an integral, finite value (8.0)."""
    if type(value) is int:
        return value
    if type(value) is float and math.isfinite(value) and value == math.floor(value):
        return int(value)
    return None


def _stopped(value: object) -> bool:
    """finish_reason says the model stopped on purpose: "stop" or {"type": "stop", ...}."""
    return value == "stop" or (type(value) is dict and value.get("type") == "stop")


def expected_reason(
    endpoint: str,
    status: int,
    raw: bytes,
    cfg: ProbeConfig,
    speculative: bool,
) -> str:
    if status != 200:
        return "http_status"
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return "malformed"
    if type(doc) is not dict:
        return "malformed"
    verify: int | None = None
    if endpoint == "chat":
        choices, usage = doc.get("choices"), doc.get("usage")
        if type(choices) is not list or not choices or type(choices[0]) is not dict:
            return "malformed"
        if type(usage) is not dict:
            return "malformed"
        message = choices[0].get("message")
        if type(message) is not dict:
            return "malformed"
        pieces = (message.get("content"), message.get("reasoning_content"))
        text = "".join(p for p in pieces if type(p) is str)
        tokens = _whole(usage.get("completion_tokens"))
        stopped = _stopped(choices[0].get("finish_reason"))
    else:
        meta = doc.get("meta_info")
        if type(meta) is not dict or type(doc.get("text")) is not str:
            return "malformed"
        text = doc["text"]
        tokens = _whole(meta.get("completion_tokens"))
        stopped = _stopped(meta.get("finish_reason"))
        verify = _whole(meta.get("spec_verify_ct"))
    if tokens is None:
        return "malformed"
    early_stop = stopped and 2 <= tokens <= cfg.max_tokens
    if tokens != cfg.max_tokens and not early_stop:
        return "too_few_tokens"
    if speculative and endpoint == "generate" and (verify is None or verify <= 0):
        return "no_speculation"
    if cfg.expect_regex is not None and re.search(cfg.expect_regex, text) is None:
        return "unexpected_text"
    return "ok"


def check(endpoint: str, status: int, raw: bytes, cfg: ProbeConfig, speculative: bool) -> str:
    verdict = judge(endpoint, status, raw, cfg, speculative)  # must not raise
    assert verdict.ok is (verdict.reason == "ok")
    assert verdict.ok or verdict.reason in FAILURE_REASONS  # a known metrics label
    assert verdict.ok or verdict.error
    want = expected_reason(endpoint, status, raw, cfg, speculative)
    assert verdict.reason == want, (verdict, want)
    if verdict.ok:
        assert verdict.completion_tokens is not None and verdict.completion_tokens >= 2
        if speculative and endpoint == "generate":
            assert verdict.spec_verify_ct is not None and verdict.spec_verify_ct > 0
    return verdict.reason


# ------------------------------------------------------------------------------ strategies

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
COUNTS = (
    st.integers(-2, 12)
    | st.sampled_from([8, 10, 2, 8.0, 10.0, 2.0, 8.5, -0.0, float("nan"), float("inf"), 10**20])
    | st.booleans()
    | st.text(max_size=3)
    | ANY_JSON
)
FINISH = (
    st.sampled_from(["stop", "length", "abort", "STOP", ""])
    | st.fixed_dictionaries(
        {"type": st.sampled_from(["stop", "length", "abort"])},
        optional={"matched": st.integers() | st.text(max_size=3), "length": st.integers()},
    )
    | ANY_JSON
)
TEXTS = st.sampled_from(["Hello!", " hello", "", "xxx", "的"]) | st.text(max_size=30) | ANY_JSON


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value, or a marker that drops the field."""
    return strategy | st.just(_DROP)


_DROP = object()


def _build(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not _DROP}


GENERATE_DOCS = st.builds(
    lambda text, meta: _build({"text": text, "meta_info": meta}),
    text=_maybe(TEXTS),
    meta=_maybe(
        st.builds(
            lambda *v: _build(
                dict(
                    zip(
                        ("completion_tokens", "finish_reason", "spec_verify_ct", "id"),
                        v,
                        strict=True,
                    )
                )
            ),
            _maybe(COUNTS),
            _maybe(FINISH),
            _maybe(COUNTS),
            _maybe(st.text(max_size=4)),
        )
        | ANY_JSON
    ),
)
CHAT_DOCS = st.builds(
    lambda choice, usage, extra: _build({"choices": choice, "usage": usage, **extra}),
    choice=_maybe(
        st.lists(
            st.builds(
                lambda message, finish: _build({"message": message, "finish_reason": finish}),
                _maybe(
                    st.builds(
                        lambda c, r: _build(
                            {"role": "assistant", "content": c, "reasoning_content": r}
                        ),
                        _maybe(TEXTS),
                        _maybe(TEXTS),
                    )
                    | ANY_JSON
                ),
                _maybe(FINISH),
            )
            | ANY_JSON,
            max_size=2,
        )
        | ANY_JSON
    ),
    usage=_maybe(st.builds(lambda n: _build({"completion_tokens": n}), _maybe(COUNTS)) | ANY_JSON),
    extra=st.just({"object": "chat.completion"}),
)
STATUS = st.sampled_from([200, 200, 200, 503, 500, 404, 0, -1, 999])


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


# ------------------------------------------------------------------------------ properties


@FUZZ
@given(raw=st.binary(max_size=300), status=STATUS, cfg=CONFIGS, speculative=st.booleans())
def test_arbitrary_bytes(raw: bytes, status: int, cfg: ProbeConfig, speculative: bool) -> None:
    check(cfg.endpoint, status, raw, cfg, speculative)


@FUZZ
@given(doc=ANY_JSON, cfg=CONFIGS, speculative=st.booleans())
def test_arbitrary_json_values(doc: Any, cfg: ProbeConfig, speculative: bool) -> None:
    check(cfg.endpoint, 200, _dumps(doc), cfg, speculative)


@FUZZ
@given(doc=GENERATE_DOCS, cfg=CONFIGS, speculative=st.booleans(), status=STATUS)
def test_generate_answers_with_wrong_types_anywhere(
    doc: Any, cfg: ProbeConfig, speculative: bool, status: int
) -> None:
    check("generate", status, _dumps(doc), cfg, speculative)


@FUZZ
@given(doc=CHAT_DOCS, cfg=CONFIGS, speculative=st.booleans(), status=STATUS)
def test_chat_answers_with_wrong_types_anywhere(
    doc: Any, cfg: ProbeConfig, speculative: bool, status: int
) -> None:
    check("chat", status, _dumps(doc), cfg, speculative)


@FUZZ
@given(
    literal=st.sampled_from(
        [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-0", b"8.0", b"8e0", b"0x8", b"08", b"8 8"]
    )
    | st.integers(4290, 4400).map(lambda n: b"9" * n)
    | st.from_regex(rb"\A-?[0-9]{1,40}(\.[0-9]{1,5})?([eE][+-]?[0-9]{1,4})?\Z"),
    cfg=CONFIGS,
    speculative=st.booleans(),
)
def test_token_count_literals(literal: bytes, cfg: ProbeConfig, speculative: bool) -> None:
    doc = {"text": "hello", "meta_info": {"completion_tokens": 123456789, "spec_verify_ct": 3}}
    raw = _dumps(doc).replace(b"123456789", literal)
    check("generate", 200, raw, cfg, speculative)


@FUZZ
@given(
    tokens=st.integers(0, 12),
    finish=st.sampled_from(["stop", "length", {"type": "stop"}, {"type": "length"}, None]),
    verify=st.integers(-1, 3),
    text=st.sampled_from(["hello", "Hello!", "", "xx"]),
    cfg=CONFIGS,
    speculative=st.booleans(),
)
def test_well_formed_answers_are_judged_exactly(
    tokens: int, finish: Any, verify: int, text: str, cfg: ProbeConfig, speculative: bool
) -> None:
    """The valid region is hit often here, so "valid implies ok" is really exercised."""
    if cfg.endpoint == "generate":
        doc: Any = {
            "text": text,
            "meta_info": {
                "completion_tokens": tokens,
                "finish_reason": finish,
                "spec_verify_ct": verify,
            },
        }
    else:
        doc = {
            "choices": [
                {"message": {"content": None, "reasoning_content": text}, "finish_reason": finish}
            ],
            "usage": {"completion_tokens": tokens},
        }
    check(cfg.endpoint, 200, _dumps(doc), cfg, speculative)


def test_the_oracle_accepts_a_real_answer() -> None:
    """The oracle must be able to say ok, or the properties above would prove little."""
    cfg = ProbeConfig("generate", "Say hello in one word", 8, 30.0, None)
    doc = {"text": " Hello", "meta_info": {"completion_tokens": 8, "spec_verify_ct": 2}}
    assert check("generate", 200, _dumps(doc), cfg, True) == "ok"


# ------------------------------------------------------------------------------ /metrics


@FUZZ
@given(text=st.text(max_size=400))
def test_parse_progress_never_raises(text: str) -> None:
    result = parse_progress(text)
    assert result is None or isinstance(result, Progress)


METRIC_LINES = st.lists(
    st.builds(
        lambda name, labels, value: f"{name}{labels} {value}",
        st.sampled_from(
            [
                "sglang:generation_tokens_total",
                "sglang:num_running_reqs",
                "sglang:gen_throughput",
                "# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total",
                "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs",
                "# HELP x y\nx",
            ]
        ),
        st.sampled_from(
            ["", '{model_name="kimi"}', '{tp_rank="0",model_name="k"}', "{", '{a="\\q"}']
        ),
        st.sampled_from(["1", "0", "-3", "1e309", "NaN", "+Inf", "x", "", "12.5 1764464400000"]),
    ),
    max_size=6,
)


@FUZZ
@given(lines=METRIC_LINES)
def test_parse_progress_on_metric_shaped_text(lines: list[str]) -> None:
    result = parse_progress("\n".join(lines) + "\n")
    assert result is None or isinstance(result, Progress)
    if result is not None:
        assert any("sglang:generation_tokens_total" in line for line in lines)
