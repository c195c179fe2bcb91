"""The decode probe: `judge()` on realistic SGLang answers, and `probe()` against real loopback
HTTP servers, well-behaved and not (refusing, hanging, trickling, dropping, flooding).

The misbehaving servers are raw asyncio servers on 127.0.0.1:0, so each misbehaviour is exactly
the bytes written; the well-behaved ones are aiohttp applications.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from supervisor import config
from supervisor.config import ProbeConfig
from supervisor.sglang.endpoints import MAX_ANSWER_BYTES as MAX_BODY_BYTES
from supervisor.sglang.probe import (
    FAILURE_REASONS,
    PROBE_PROMPT_ALLOWANCE,
    ProbeResult,
    Progress,
    is_busy,
    judge,
    parse_progress,
    probe,
    prompt_token_bound,
    read_progress,
    request_for,
)
from testkit import free_port
from testkit.loopback import read_request

PROMPT = "Say hello in one word"
GENERATE = ProbeConfig("generate", PROMPT, max_tokens=8, timeout=5.0, expect_regex=None)
CHAT = ProbeConfig("chat", PROMPT, max_tokens=10, timeout=5.0, expect_regex=None)


def with_(cfg: ProbeConfig, **changes: Any) -> ProbeConfig:
    return dataclasses.replace(cfg, **changes)


# ------------------------------------------------------------------------------ SGLang answers


def generate_answer(
    tokens: int = 8,
    finish: Any = None,
    spec_verify_ct: Any = 3,
    text: str = " Hello! How can I help you today",
    **meta: Any,
) -> dict[str, Any]:
    """A /generate answer as SGLang 0.5.x sends it."""
    info: dict[str, Any] = {
        "id": "5f1c0e3f0a8b4c8d9d3c1e2f",
        "finish_reason": finish if finish is not None else {"type": "length", "length": tokens},
        "prompt_tokens": 7,
        "weight_version": "default",
        "completion_tokens": tokens,
        "cached_tokens": 0,
        "spec_accept_length": 2.67,
        "e2e_latency": 0.0412,
    }
    if spec_verify_ct is not None:
        info["spec_verify_ct"] = spec_verify_ct
    info.update(meta)
    return {"text": text, "output_ids": list(range(100, 100 + tokens)), "meta_info": info}


def chat_answer(
    tokens: int = 10,
    finish: Any = "length",
    content: str | None = "Hello! How can I help you today?",
    reasoning: str | None = None,
) -> dict[str, Any]:
    """A /v1/chat/completions answer (OpenAI schema, SGLang's kimi_k2 reasoning parser)."""
    return {
        "id": "chatcmpl-7f2a",
        "object": "chat.completion",
        "created": 1764464523,
        "model": "kimi-k2.5",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "reasoning_content": reasoning,
                    "tool_calls": None,
                },
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": None,
            }
        ],
        "usage": {
            "prompt_tokens": 12,
            "total_tokens": 12 + tokens,
            "completion_tokens": tokens,
            "prompt_tokens_details": None,
        },
    }


def body(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def gen(doc: Any, cfg: ProbeConfig = GENERATE, speculative: bool = True, status: int = 200) -> Any:
    return judge("generate", status, body(doc), cfg, speculative)


def chat(doc: Any, cfg: ProbeConfig = CHAT, speculative: bool = False, status: int = 200) -> Any:
    return judge("chat", status, body(doc), cfg, speculative)


# ------------------------------------------------------------------------------ judge: /generate


def test_generate_full_answer_is_ok() -> None:
    v = gen(generate_answer())
    assert (v.ok, v.reason, v.error) == (True, "ok", None)
    assert (v.completion_tokens, v.spec_verify_ct) == (8, 3)
    assert v.text == " Hello! How can I help you today"
    assert v.meta["finish_reason"] == {"type": "length", "length": 8}


def test_generate_early_stop_after_several_tokens_is_ok() -> None:
    # EOS after 3 tokens: the decode loop ran, the model chose to stop.
    v = gen(generate_answer(3, finish={"type": "stop", "matched": 163586}, text=" Hello!"))
    assert v.ok and v.completion_tokens == 3


@pytest.mark.parametrize(
    ("tokens", "finish"),
    [
        (0, {"type": "stop", "matched": 163586}),  # the zero-token fault
        (0, {"type": "length", "length": 0}),
        (1, {"type": "stop", "matched": 163586}),  # what /health checks: prefill only
        (1, {"type": "length", "length": 1}),
        (7, {"type": "length", "length": 7}),
        (5, {"type": "abort", "message": "Abort before prefill"}),
        (5, None),
    ],
)
def test_generate_too_few_tokens(tokens: int, finish: Any) -> None:
    doc = generate_answer(tokens, finish=finish)
    if finish is None:
        doc["meta_info"]["finish_reason"] = None
    v = gen(doc)
    assert (v.ok, v.reason) == (False, "too_few_tokens")
    assert v.completion_tokens == tokens
    assert f"generated {tokens} of 8 tokens" in (v.error or "")


def test_zero_tokens_is_too_few_even_without_speculation() -> None:
    v = gen(generate_answer(0, finish={"type": "stop"}, spec_verify_ct=0), speculative=False)
    assert v.reason == "too_few_tokens"


@pytest.mark.parametrize("verify", [0, None, "3", 2.5, True, -1])
def test_no_speculation(verify: Any) -> None:
    doc = generate_answer(spec_verify_ct=verify)
    v = gen(doc, speculative=True)
    assert (v.ok, v.reason) == (False, "no_speculation")
    assert "spec_verify_ct" in (v.error or "")
    assert v.completion_tokens == 8


def test_spec_verify_ct_is_not_needed_without_speculation() -> None:
    assert gen(generate_answer(spec_verify_ct=None), speculative=False).ok
    assert gen(generate_answer(spec_verify_ct=0), speculative=False).ok


def test_absent_spec_keys_read_as_no_verification_ran() -> None:
    # Real SGLang 0.5.23 leaves every spec_* key out of meta_info when verify did not run.
    doc = generate_answer(spec_verify_ct=None)
    doc["meta_info"].pop("spec_accept_length")
    assert not any(k.startswith("spec_") for k in doc["meta_info"])
    assert gen(doc, speculative=False).ok
    v = gen(doc, speculative=True)
    assert (v.ok, v.reason, v.spec_verify_ct) == (False, "no_speculation", None)
    assert "no speculative verification ran" in (v.error or "")
    # A present but zero count says so as such.
    zero = gen(generate_answer(spec_verify_ct=0), speculative=True)
    assert "spec_verify_ct is 0" in (zero.error or "")


def test_too_few_tokens_is_reported_before_no_speculation() -> None:
    assert gen(generate_answer(0, spec_verify_ct=0)).reason == "too_few_tokens"


def test_integral_float_token_count_is_accepted() -> None:
    assert gen(generate_answer(spec_verify_ct=3.0, completion_tokens=8.0)).ok


def test_expect_regex() -> None:
    cfg = with_(GENERATE, expect_regex=r"(?i)hello")
    assert gen(generate_answer(text=" Hello there"), cfg).ok
    v = gen(generate_answer(text=" 的的的的的的的的"), cfg)
    assert (v.ok, v.reason) == (False, "unexpected_text")
    assert "expect_regex" in (v.error or "")


def test_expect_regex_searches_the_whole_text_not_the_stored_excerpt() -> None:
    cfg = with_(GENERATE, expect_regex=r"needle$")
    v = gen(generate_answer(text="x" * 500 + "needle"), cfg)
    assert v.ok
    assert v.text is not None and len(v.text) == 200


def test_unexpected_text_comes_after_the_token_checks() -> None:
    cfg = with_(GENERATE, expect_regex="hello")
    assert gen(generate_answer(1, finish={"type": "stop"}, text="x"), cfg).reason == (
        "too_few_tokens"
    )


@pytest.mark.parametrize(
    ("status", "raw", "expected"),
    [
        (
            500,
            b'{"error": "Internal Server Error"}',
            'HTTP 500: {"error": "Internal Server Error"}',
        ),
        (400, b"", "HTTP 400"),
        (404, b'{"detail":"Not Found"}', 'HTTP 404: {"detail":"Not Found"}'),
        (502, b"\xff\xfe bad gateway", "HTTP 502: \ufffd\ufffd bad gateway"),
        (503, b"x" * 1000, "HTTP 503: " + "x" * 200),
    ],
)
def test_http_status(status: int, raw: bytes, expected: str) -> None:
    v = judge("generate", status, raw, GENERATE, True)
    assert (v.ok, v.reason, v.error) == (False, "http_status", expected)


def test_a_200_with_an_error_body_is_malformed() -> None:
    v = gen({"object": "error", "message": "The engine is not ready", "code": 503})
    assert (v.ok, v.reason) == (False, "malformed")


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"<html>502 Bad Gateway</html>",
        b'{"text": "hi", "meta_info": ',
        b"[]",
        b'"ok"',
        b"null",
        b"8",
        b"\xff\xfe\x00garbage",
        b"[" * 100_000,  # deeper than the JSON parser's recursion limit
        b'{"text": "x", "meta_info": {"completion_tokens": ' + b"9" * 5000 + b"}}",
    ],
)
def test_not_a_json_object_is_malformed(raw: bytes) -> None:
    v = judge("generate", 200, raw, GENERATE, True)
    assert (v.ok, v.reason) == (False, "malformed")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("meta_info"),
        lambda d: d.update(meta_info=[]),
        lambda d: d.pop("text"),
        lambda d: d.update(text=None),
        lambda d: d.update(text=8),
        lambda d: d["meta_info"].pop("completion_tokens"),
        lambda d: d["meta_info"].update(completion_tokens="8"),
        lambda d: d["meta_info"].update(completion_tokens=True),
        lambda d: d["meta_info"].update(completion_tokens=8.5),
        lambda d: d["meta_info"].update(completion_tokens=None),
    ],
)
def test_generate_missing_or_mistyped_fields_are_malformed(mutate: Callable[[Any], Any]) -> None:
    doc = generate_answer()
    mutate(doc)
    v = gen(doc)
    assert (v.ok, v.reason) == (False, "malformed"), v


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_token_counts_are_malformed(literal: bytes) -> None:
    raw = body(generate_answer()).replace(
        b'"completion_tokens": 8', b'"completion_tokens": ' + literal
    )
    assert b'completion_tokens": 8' not in raw
    assert judge("generate", 200, raw, GENERATE, True).reason == "malformed"


def test_more_tokens_than_requested_is_not_ok() -> None:
    v = gen(generate_answer(50, finish={"type": "stop", "matched": 163586}))
    assert not v.ok


def test_the_verdict_keeps_meta_info_for_the_intent_check() -> None:
    v = gen(generate_answer(spec_accept_length=3.1))
    assert v.meta["spec_accept_length"] == 3.1


# ------------------------------------------------------------------------------ judge: chat


def test_chat_full_answer_is_ok() -> None:
    v = chat(chat_answer())
    assert (v.ok, v.completion_tokens, v.spec_verify_ct) == (True, 10, None)
    assert v.text == "Hello! How can I help you today?"


def test_chat_answer_entirely_in_reasoning_content_is_ok() -> None:
    # kimi_k2 reasoning parser: 10 tokens of thinking, nothing in content yet.
    v = chat(chat_answer(content=None, reasoning="The user wants a one-word greeting. I"))
    assert v.ok
    assert v.text == "The user wants a one-word greeting. I"


def test_chat_text_joins_content_and_reasoning_for_expect_regex() -> None:
    cfg = with_(CHAT, expect_regex=r"greeting")
    assert chat(chat_answer(content="Hi", reasoning="a greeting"), cfg).ok
    assert chat(chat_answer(content="Hi", reasoning=None), cfg).reason == "unexpected_text"


def test_chat_empty_content_is_judged_by_usage() -> None:
    assert chat(chat_answer(content="", reasoning=None)).ok


@pytest.mark.parametrize(
    ("tokens", "finish", "ok"),
    [
        (10, "length", True),
        (3, "stop", True),
        (2, {"type": "stop"}, True),
        (1, "stop", False),
        (0, "stop", False),
        (9, "length", False),
        (4, "abort", False),
        (4, None, False),
    ],
)
def test_chat_token_counts(tokens: int, finish: Any, ok: bool) -> None:
    v = chat(chat_answer(tokens, finish=finish))
    assert v.ok is ok
    if not ok:
        assert v.reason == "too_few_tokens"


def test_chat_does_not_check_speculation() -> None:
    # The OpenAI schema has no spec_verify_ct: /generate is the endpoint that can prove EAGLE ran.
    assert chat(chat_answer(), speculative=True).ok


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("choices"),
        lambda d: d.update(choices=[]),
        lambda d: d.update(choices={"0": {}}),
        lambda d: d.update(choices=["text"]),
        lambda d: d.pop("usage"),
        lambda d: d.update(usage=None),
        lambda d: d["choices"][0].pop("message"),
        lambda d: d["choices"][0].update(message="Hello"),
        lambda d: d["usage"].pop("completion_tokens"),
        lambda d: d["usage"].update(completion_tokens="10"),
    ],
)
def test_chat_missing_or_mistyped_fields_are_malformed(mutate: Callable[[Any], Any]) -> None:
    doc = chat_answer()
    mutate(doc)
    assert chat(doc).reason == "malformed"


def test_a_generate_answer_to_a_chat_probe_is_malformed() -> None:
    assert chat(generate_answer()).reason == "malformed"
    assert gen(chat_answer()).reason == "malformed"


# ------------------------------------------------------------------------------ request_for


def test_generate_request() -> None:
    path, doc = request_for(GENERATE)
    assert path == "/generate"
    assert doc == {
        "text": "Say hello in one word",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "stream": False,
    }


def test_chat_request() -> None:
    path, doc = request_for(CHAT)
    assert path == "/v1/chat/completions"
    assert doc["messages"] == [{"role": "user", "content": "Say hello in one word"}]
    assert (doc["max_tokens"], doc["temperature"], doc["stream"]) == (10, 0, False)


def test_config_defaults_make_a_strict_probe() -> None:
    cfg = config.parse("sglang: {model_path: /m}\n", "test.yaml").readiness.probe
    assert (cfg.endpoint, cfg.max_tokens, cfg.timeout) == ("generate", 8, 30.0)


# ------------------------------------------------------------------------------ servers


@asynccontextmanager
async def app_server(
    routes: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]],
) -> AsyncIterator[str]:
    app = web.Application()
    for path, handler in routes.items():
        method = "GET" if path == "/metrics" else "POST"
        app.router.add_route(method, path, handler)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(behave: Behaviour) -> AsyncIterator[str]:
    """Reads one request per connection, then does exactly what `behave` writes."""
    tasks: set[asyncio.Task[Any]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await read_request(reader)
            await behave(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


def json_handler(doc: Any, status: int = 200) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(doc, status=status)

    return handler


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as c:
        yield c


# ------------------------------------------------------------------------------ probe()


async def probe_(*args: Any, **kwargs: Any) -> ProbeResult:
    """probe(), plus what holds for every result: a known reason, a sane latency."""
    result = await probe(*args, **kwargs)
    assert result.ok is (result.reason == "ok")
    assert result.ok or (result.reason in FAILURE_REASONS and result.error)
    assert result.latency_s >= 0
    assert not (result.not_up and result.ok)
    return result


async def test_probe_ok_sends_the_probe_request(client: httpx.AsyncClient) -> None:
    seen: list[Any] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(generate_answer())

    async with app_server({"/generate": handler}) as url:
        result = await probe_(client, url, GENERATE, speculative=True)
    assert (result.ok, result.reason, result.not_up) == (True, "ok", False)
    assert (result.completion_tokens, result.spec_verify_ct) == (8, 3)
    assert 0 < result.latency_s < 5
    assert seen == [request_for(GENERATE)[1]]
    assert result.to_status()["completion_tokens"] == 8
    assert "meta" not in result.to_status()


async def test_probe_chat_with_reasoning_only(client: httpx.AsyncClient) -> None:
    doc = chat_answer(content=None, reasoning="Thinking about a greeting")
    async with app_server({"/v1/chat/completions": json_handler(doc)}) as url:
        result = await probe_(client, url + "/", CHAT, speculative=False)
    assert result.ok and result.completion_tokens == 10


async def test_probe_judges_the_answer(client: httpx.AsyncClient) -> None:
    doc = generate_answer(0, finish={"type": "stop", "matched": 163586})
    async with app_server({"/generate": json_handler(doc)}) as url:
        result = await probe_(client, url, GENERATE, speculative=True)
    assert (result.ok, result.reason, result.not_up) == (False, "too_few_tokens", False)
    assert result.completion_tokens == 0


async def test_probe_http_500(client: httpx.AsyncClient) -> None:
    async with app_server({"/generate": json_handler({"error": "boom"}, 500)}) as url:
        result = await probe_(client, url, GENERATE, speculative=True)
    assert (result.ok, result.reason, result.not_up) == (False, "http_status", False)
    assert (result.error or "").startswith("HTTP 500")


async def test_probe_503_is_not_up(client: httpx.AsyncClient) -> None:
    async with app_server({"/generate": json_handler({"detail": "starting"}, 503)}) as url:
        result = await probe_(client, url, GENERATE, speculative=True)
    assert (result.ok, result.reason, result.not_up) == (False, "http_status", True)


async def test_probe_connection_refused_is_not_up(client: httpx.AsyncClient) -> None:
    start = time.monotonic()
    result = await probe_(client, f"http://127.0.0.1:{free_port()}", GENERATE, True, timeout=2.0)
    assert (result.ok, result.reason, result.not_up) == (False, "connect", True)
    assert time.monotonic() - start < 1.0


async def test_probe_connection_closed_before_an_answer(client: httpx.AsyncClient) -> None:
    async def close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async with raw_server(close) as url:
        result = await probe_(client, url, GENERATE, speculative=True)
    assert (result.ok, result.reason, result.not_up) == (False, "connection_lost", False)


async def test_probe_connection_closed_mid_answer(client: httpx.AsyncClient) -> None:
    full = body(generate_answer())

    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(full)}\r\n\r\n".encode()
            + full[: len(full) // 2]
        )
        await writer.drain()
        writer.close()

    async with raw_server(half) as url:
        result = await probe_(client, url, GENERATE, speculative=True)
    assert (result.ok, result.reason, result.not_up) == (False, "connection_lost", False)
    assert result.error


async def test_probe_garbage_instead_of_http(client: httpx.AsyncClient) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        writer.close()

    async with raw_server(garbage) as url:
        result = await probe_(client, url, GENERATE, speculative=True)
    assert not result.ok and result.reason == "connection_lost"


async def test_probe_server_that_never_answers_times_out(client: httpx.AsyncClient) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.Event().wait()

    async with raw_server(silent) as url:
        start = time.monotonic()
        result = await probe_(client, url, GENERATE, speculative=True, timeout=0.5)
        elapsed = time.monotonic() - start
    assert (result.ok, result.reason, result.not_up) == (False, "timeout", False)
    assert 0.45 <= elapsed < 1.0
    assert result.error == "no answer within 0.5s"


@pytest.mark.parametrize("where", ["body", "headers"])
async def test_probe_slow_loris_times_out_at_the_total_deadline(
    client: httpx.AsyncClient, where: str
) -> None:
    # One byte every 0.2 s never trips a per-read timeout; only a total deadline ends it.
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if where == "body":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            drip = b" " * 100_000
        else:
            drip = b"HTTP/1.1 200 OK\r\nX-Padding: " + b"a" * 100_000
        for byte in drip:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.2)

    timeout = 1.0
    async with raw_server(trickle) as url:
        start = time.monotonic()
        result = await probe_(client, url, GENERATE, speculative=True, timeout=timeout)
        elapsed = time.monotonic() - start
    assert (result.ok, result.reason) == (False, "timeout")
    assert timeout - 0.05 <= elapsed < timeout + 0.5


async def test_probe_uses_the_config_timeout_by_default(client: httpx.AsyncClient) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.Event().wait()

    async with raw_server(silent) as url:
        start = time.monotonic()
        result = await probe_(client, url, with_(GENERATE, timeout=0.3), speculative=True)
    assert result.reason == "timeout"
    assert time.monotonic() - start < 0.8


async def test_probe_huge_body_is_malformed(client: httpx.AsyncClient) -> None:
    huge = b'{"text": "' + b"a" * (MAX_BODY_BYTES + 1024) + b'"}'

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(huge)}\r\n\r\n".encode())
        writer.write(huge)
        await writer.drain()

    async with raw_server(flood) as url:
        result = await probe_(client, url, GENERATE, speculative=True)
    assert (result.ok, result.reason) == (False, "malformed")
    assert str(MAX_BODY_BYTES) in (result.error or "")


async def test_probe_endless_chunked_body_is_malformed(client: httpx.AsyncClient) -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        while True:
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()

    async with raw_server(endless) as url:
        result = await probe_(client, url, GENERATE, speculative=True, timeout=5.0)
    assert (result.ok, result.reason) == (False, "malformed")


async def test_probe_body_exactly_at_the_limit_is_read(client: httpx.AsyncClient) -> None:
    doc = generate_answer()
    raw = body(doc)
    padded = raw[:-1] + b" " * (MAX_BODY_BYTES - len(raw)) + b"}"
    assert len(padded) == MAX_BODY_BYTES

    async def exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(padded)}\r\n\r\n".encode())
        writer.write(padded)
        await writer.drain()

    async with raw_server(exact) as url:
        result = await probe_(client, url, GENERATE, speculative=True)
    assert result.ok


@pytest.mark.parametrize("url", ["http://::1:30000", "http://[::1", "http://127.0.0.1:99999"])
async def test_probe_never_raises_on_a_bad_url(client: httpx.AsyncClient, url: str) -> None:
    result = await probe_(client, url, GENERATE, speculative=True, timeout=1.0)
    assert not result.ok and result.error


async def test_probe_latency_comes_from_the_injected_clock(client: httpx.AsyncClient) -> None:
    ticks = iter([100.0, 102.5])
    async with app_server({"/generate": json_handler(generate_answer())}) as url:
        result = await probe_(client, url, GENERATE, True, clock=lambda: next(ticks))
    assert result.latency_s == 2.5


async def test_probe_reads_a_compressed_answer(client: httpx.AsyncClient) -> None:
    async def compressed(request: web.Request) -> web.Response:
        response = web.json_response(generate_answer())
        response.enable_compression()
        return response

    async with app_server({"/generate": compressed}) as url:
        result = await probe_(client, url, GENERATE, speculative=True)
    assert result.ok, result


# ------------------------------------------------------------------------------ busy detection

SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{engine_type="unified",model_name="kimi-k2.5",tp_rank="0"}} {running}
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{engine_type="unified",model_name="kimi-k2.5",tp_rank="0"}} 12.0
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{{engine_type="unified",model_name="kimi-k2.5",tp_rank="0"}} 812.4
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{model_name="kimi-k2.5"}} {tokens}
sglang:generation_tokens_created{{model_name="kimi-k2.5"}} 1.7644644e+09
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{{le="0.1",model_name="kimi-k2.5"}} 3.0
sglang:time_to_first_token_seconds_bucket{{le="+Inf",model_name="kimi-k2.5"}} 9.0
sglang:time_to_first_token_seconds_sum{{model_name="kimi-k2.5"}} 2.5
sglang:time_to_first_token_seconds_count{{model_name="kimi-k2.5"}} 9.0
"""


def metrics_text(tokens: float = 15328.0, running: float = 3.0) -> str:
    return SGLANG_METRICS.format(tokens=tokens, running=running)


def test_parse_progress_reads_sglang_metrics() -> None:
    assert parse_progress(metrics_text(15328.0, 3.0)) == Progress(15328.0, 3.0, None, 12.0)


def test_parse_progress_sums_label_sets() -> None:
    text = (
        'sglang:generation_tokens_total{model_name="a"} 10\n'
        'sglang:generation_tokens_total{model_name="b"} 5\n'
        'sglang:num_running_reqs{tp_rank="0"} 1\n'
    )
    assert parse_progress(text) == Progress(15.0, 1.0)
    assert parse_progress(text + 'sglang:num_queue_reqs{tp_rank="1"} 4\n') == Progress(
        15.0, 1.0, None, 4.0
    )


def test_parse_progress_without_type_lines() -> None:
    # No gauges exported at all: unknown, not zero.
    assert parse_progress("sglang:generation_tokens_total 42\n") == Progress(42.0, None)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# HELP nothing here\n",
        'sglang:num_running_reqs{tp_rank="0"} 3\n',  # metrics on, but no generation counter
        "<html><body>404 Not Found</body></html>",
        'sglang:generation_tokens_total{model_name="kimi} 1\n',
        "sglang:generation_tokens_total one\n",
        "\x00\xff\ufffd",
        "{" * 10_000,
        'python_gc_objects_collected_total{generation="0"} 301.0\n',
    ],
)
def test_parse_progress_garbage_is_none(text: str) -> None:
    assert parse_progress(text) is None


@pytest.mark.parametrize(
    ("before", "after", "busy"),
    [
        (Progress(100, 2), Progress(180, 2), True),
        # The counter moved but no request was running or queued at either read: not busy.
        (Progress(100, 0), Progress(100.5, 0), False),
        (Progress(100, 0), Progress(100.5, 1), True),
        (Progress(100, None), Progress(100.5, None), True),  # no gauges: the counter decides
        (Progress(100, 5), Progress(100, 5), False),  # requests running, nothing generated: hung
        (Progress(100, 0), Progress(40, 0), False),  # counter reset: SGLang restarted
        (None, Progress(180, 0), False),
        (Progress(100, 0), None, False),
        (None, None, False),
        (Progress(float("nan"), 0), Progress(1, 0), False),
    ],
)
def test_is_busy(before: Progress | None, after: Progress | None, busy: bool) -> None:
    assert is_busy(TIMED_OUT, before, after, own_tokens=0) is busy


TIMED_OUT = ProbeResult(False, "timeout", "no answer within 20s", 20.0)


def test_is_busy_from_two_scrapes() -> None:
    before = parse_progress(metrics_text(15328.0))
    after = parse_progress(metrics_text(15590.0))
    assert is_busy(TIMED_OUT, before, after, own_tokens=8)
    assert not is_busy(TIMED_OUT, before, parse_progress(metrics_text(15328.0)), own_tokens=8)


def test_only_a_timeout_can_be_busy() -> None:
    # A wrong answer is wrong however loaded the server is.
    before, after = Progress(100, 1), Progress(900, 1)
    for reason in ("no_speculation", "too_few_tokens", "http_status", "connection_lost"):
        assert not is_busy(ProbeResult(False, reason, "x", 1.0), before, after, own_tokens=8)
    assert is_busy(TIMED_OUT, before, after, own_tokens=8)


def test_the_probes_own_tokens_are_not_busyness() -> None:
    assert not is_busy(TIMED_OUT, Progress(100, 1), Progress(108, 1), own_tokens=8)
    assert is_busy(TIMED_OUT, Progress(100, 1), Progress(109, 1), own_tokens=8)


async def test_read_progress_from_a_server(client: httpx.AsyncClient) -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=metrics_text(777.0), content_type="text/plain")

    async with app_server({"/metrics": metrics}) as url:
        assert await read_progress(client, url) == Progress(777.0, 3.0, None, 12.0)


async def test_read_progress_without_metrics_is_none(client: httpx.AsyncClient) -> None:
    async with app_server({}) as url:  # --enable-metrics off: 404
        assert await read_progress(client, url) is None
    assert await read_progress(client, f"http://127.0.0.1:{free_port()}") is None


@pytest.mark.parametrize("kind", ["liveness", "readiness"])
async def test_a_wrong_answer_is_not_excused_by_its_own_tokens(tmp_path: Path, kind: str) -> None:
    from supervisor.core.machine import ProbeDone, ProbeKind
    from supervisor.daemon import probing
    from supervisor.sglang import argv as command

    generated = {"tokens": 15328}

    async def generate(request: web.Request) -> web.Response:
        generated["tokens"] += 8  # SGLang counts this request's own 8 tokens
        return web.json_response(generate_answer(spec_verify_ct=0))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=metrics_text(generated["tokens"]), content_type="text/plain")

    async with app_server({"/generate": generate, "/metrics": metrics}) as url:
        port = int(url.rsplit(":", 1)[1])
        cfg = config.parse(
            f"sglang:\n  model_path: /m\n  port: {port}\n"
            "  args: {speculative-algorithm: EAGLE3}\n"
            f"state_dir: {tmp_path}\ngpus: {{manage: false}}\n",
            "test.yaml",
        )
        async with httpx.AsyncClient(trust_env=False) as http:
            event = await probing.decode(http, cfg, command.build(cfg), 1, ProbeKind(kind))
    assert isinstance(event, ProbeDone)
    assert event.result.reason == "no_speculation"
    assert event.busy is False


def test_probe_result_defaults() -> None:
    r = ProbeResult(False, "timeout", "no answer within 30s", 30.0)
    assert (r.completion_tokens, r.spec_verify_ct, r.text, r.not_up) == (None, None, None, False)


# Real SGLang 0.5.23 under load: one long generation running, none finished yet. The generation
# counter (moves when a request finishes) stands still; the scheduler's realtime counter moves.
REAL_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{labels}}} {running}
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{labels}}} {queued}
# HELP sglang:realtime_tokens_total Total number of tokens processed.
# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{{{labels},mode="prefill_compute"}} {prefill}
sglang:realtime_tokens_total{{{labels},mode="decode"}} {decode}
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{engine_type="unified",model_name="m"}} 2008.0
"""


REAL_LABELS = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"'


def real_metrics(
    decode: float, running: float = 1.0, queued: float = 0.0, prefill: float = 370.0
) -> str:
    return REAL_METRICS.format(
        decode=decode, running=running, queued=queued, prefill=prefill, labels=REAL_LABELS
    )


def test_parse_progress_sums_the_realtime_modes() -> None:
    got = parse_progress(real_metrics(2378.0, running=2.0, queued=4.0))
    assert got == Progress(2008.0, 2.0, 370.0 + 2378.0, 4.0, 2378.0)
    assert got is not None and got.tokens == 2748.0 and got.has_work


def test_busy_on_the_realtime_counter_while_no_request_finishes() -> None:
    # Measured on real SGLang: generation_tokens_total 2008 -> 2008, realtime decode
    # 2378 -> 3015 over 3 s. The old rule (generation counter) called this hung.
    before = parse_progress(real_metrics(2378.0))
    after = parse_progress(real_metrics(3015.0))
    assert is_busy(TIMED_OUT, before, after, own_tokens=8)


def test_saturated_server_with_only_queued_requests_is_busy() -> None:
    before = parse_progress(real_metrics(2378.0, running=0.0, queued=6.0))
    after = parse_progress(real_metrics(3015.0, running=0.0, queued=6.0))
    assert is_busy(TIMED_OUT, before, after, own_tokens=8)


def test_hung_scheduler_with_running_requests_is_not_busy() -> None:
    # A hung scheduler leaves its gauges where they were and its counter flat.
    before = parse_progress(real_metrics(2378.0, running=2.0, queued=4.0))
    after = parse_progress(real_metrics(2378.0, running=2.0, queued=4.0))
    assert not is_busy(TIMED_OUT, before, after, own_tokens=8)


def test_idle_server_is_not_busy_even_if_the_counter_moved() -> None:
    before = parse_progress(real_metrics(2378.0, running=0.0, queued=0.0))
    after = parse_progress(real_metrics(3015.0, running=0.0, queued=0.0))
    assert not is_busy(TIMED_OUT, before, after, own_tokens=8)


def test_the_probes_own_prompt_and_tokens_are_not_busyness_on_the_realtime_counter() -> None:
    # Each mode is held against what the probe can add to it: its tokens to decode, its
    # prompt to prefill.
    before = parse_progress(real_metrics(1000.0))
    own_decode = parse_progress(real_metrics(1008.0, prefill=370.0 + PROBE_PROMPT_ALLOWANCE))
    assert not is_busy(TIMED_OUT, before, own_decode, 8)
    assert is_busy(TIMED_OUT, before, parse_progress(real_metrics(1009.0)), 8)
    more_prefill = real_metrics(1000.0, prefill=370.0 + PROBE_PROMPT_ALLOWANCE + 1)
    assert is_busy(TIMED_OUT, before, parse_progress(more_prefill), 8)


def test_a_slow_decode_for_others_is_busy() -> None:
    # Measured on a loaded 2-core machine: ~30 tokens/s for two running requests, ~60 in a
    # 2 s probe window: far more than the probe's own 8, though less than 8 + its prompt.
    before = parse_progress(real_metrics(6954.0, running=2.0, queued=4.0))
    after = parse_progress(real_metrics(7012.0, running=2.0, queued=4.0))
    assert is_busy(TIMED_OUT, before, after, own_tokens=8)


def test_prompt_token_bound_follows_the_configured_prompt() -> None:
    gen_cfg = with_(GENERATE, prompt="Say hello in one word")
    assert prompt_token_bound(gen_cfg) == 21 <= PROBE_PROMPT_ALLOWANCE
    chat = with_(GENERATE, endpoint="chat", prompt="Say hello in one word")
    assert prompt_token_bound(chat) == 21 + 32
    long = with_(GENERATE, prompt="é" * 100)
    assert prompt_token_bound(long) == 200
    # A long prompt's own prefill is not busyness.
    before = parse_progress(real_metrics(1000.0))
    after = parse_progress(real_metrics(1008.0, prefill=370.0 + 200))
    assert is_busy(TIMED_OUT, before, after, 8)  # the default allowance is smaller
    assert not is_busy(TIMED_OUT, before, after, 8, prompt_tokens=prompt_token_bound(long))


def test_generation_counter_is_only_the_fallback() -> None:
    # Realtime present in both reads: a moving generation counter alone does not make busy.
    before = Progress(100.0, 1.0, 5000.0, 0.0)
    after = Progress(900.0, 1.0, 5000.0, 0.0)
    assert not is_busy(TIMED_OUT, before, after, own_tokens=8)
    # Realtime absent (an older release, the stand-in): the generation counter decides.
    assert is_busy(TIMED_OUT, Progress(100.0, 1.0), Progress(900.0, 1.0), own_tokens=8)


def test_realtime_counter_before_any_request_finished() -> None:
    # No generation sample exists until the first request finishes.
    text = real_metrics(50.0).replace("sglang:generation_tokens_total{", "#")
    got = parse_progress(text)
    assert got is not None and got.generation_tokens is None and got.realtime_tokens == 420.0


async def test_daemon_probes_through_the_gate_never_overlap_and_are_aborted(
    tmp_path: Path,
) -> None:
    # Two probes asked for at once (racing timers) against a server that never answers: the
    # server sees one at a time, each with its own rid, and each is aborted when it times out.
    from supervisor.core.machine import ProbeKind
    from supervisor.daemon import probing
    from supervisor.sglang import argv as command
    from supervisor.sglang.probe import ProbeGate

    seen: dict[str, Any] = {"now": 0, "most": 0, "rids": [], "aborted": []}
    release = asyncio.Event()

    async def generate(request: web.Request) -> web.Response:
        seen["rids"].append((await request.json()).get("rid"))
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        try:
            await release.wait()
        finally:
            seen["now"] -= 1
        return web.json_response(generate_answer())

    async def abort(request: web.Request) -> web.Response:
        seen["aborted"].append((await request.json())["rid"])
        return web.Response()

    async with app_server({"/generate": generate, "/abort_request": abort}) as url:
        port = int(url.rsplit(":", 1)[1])
        cfg = config.parse(
            f"sglang:\n  model_path: /m\n  port: {port}\n"
            "liveness: {timeout: 0.3s}\n"
            f"state_dir: {tmp_path}\ngpus: {{manage: false}}\n",
            "test.yaml",
        )
        gate = ProbeGate()
        async with httpx.AsyncClient(trust_env=False) as http:
            spec = command.build(cfg)
            done = await asyncio.gather(
                *(probing.decode(http, cfg, spec, 1, ProbeKind.LIVENESS, gate=gate) for _ in "ab")
            )
        release.set()
    assert [d.result.reason for d in done] == ["timeout", "timeout"]
    assert gate.max_in_flight == 1 and seen["most"] == 1
    rids = seen["rids"]
    assert len(set(rids)) == 2 and all(r.startswith("kimi-serve-liveness-") for r in rids)
    assert seen["aborted"] == rids
    assert all(d.result.aborted for d in done)
