"""The decode probe against a server that answers badly: a real loopback HTTP server (asyncio
streams, so it can say things no HTTP library would) behind `supervisor.sglang.probe.probe()`.

Whatever comes back - arbitrary bytes, truncated or mistyped JSON, a huge body, a trickle,
headers and then silence, broken HTTP - the probe never raises, never passes unless the answer
is a valid multi-token decode, and never takes longer than its timeout (plus a small margin).
The pure verdict, `judge()`, is fuzzed on its own in tests/unit/test_probe_fuzz.py; this file
is the network side.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.config import ProbeConfig
from supervisor.daemon import probing
from supervisor.sglang import endpoints
from supervisor.sglang.endpoints import MAX_ANSWER_BYTES as MAX_BODY_BYTES
from supervisor.sglang.probe import ProbeResult, judge, probe
from testkit.loopback import read_request
from testkit.reliability import soak_factor, trial

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 0.3
# asyncio.timeout fires on the loop's next turn; closing the connection is one more.
MARGIN_S = 0.25
MAX_TOKENS = 8
GENERATE = ProbeConfig("generate", "Say hello in one word", MAX_TOKENS, TIMEOUT_S, None)
CHAT = ProbeConfig("chat", "Say hello in one word", MAX_TOKENS, TIMEOUT_S, None)

Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def fuzz_settings(examples: int) -> Any:
    """Fixed examples in CI (derandomized: a red run is reproducible); KIMI_SERVE_RELIABILITY_SOAK
    multiplies them and draws fresh ones."""
    soak = soak_factor()
    return settings(
        max_examples=examples * soak,
        deadline=None,
        database=None,
        derandomize=soak == 1,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# --------------------------------------------------------------------------- the server


class Server:
    """Loopback TCP server: reads each request, then lets the next behaviour answer it."""

    def __init__(self, *behaviours: Behaviour) -> None:
        self.behaviours: deque[Behaviour] = deque(behaviours)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.requests = 0

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await read_request(reader)
            self.requests += 1
            behaviour = (
                self.behaviours.popleft() if len(self.behaviours) > 1 else self.behaviours[0]
            )
            await behaviour(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self.tasks.discard(task)
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()


async def _until_client_leaves(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        while await reader.read(65536):
            pass


def send(data: bytes) -> Behaviour:
    """Write `data`, then close the connection."""

    async def b(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()

    return b


def send_then_hang(data: bytes) -> Behaviour:
    """Write `data`, then say nothing more and keep the connection open."""

    async def b(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        await _until_client_leaves(reader)

    return b


def trickle(data: bytes, interval: float, step: int = 1) -> Behaviour:
    """Slow-loris: `step` bytes every `interval` seconds, then hang."""

    async def b(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i in range(0, len(data), step):
            writer.write(data[i : i + step])
            await writer.drain()
            await asyncio.sleep(interval)
        await _until_client_leaves(reader)

    return b


def endless(head: bytes, chunk: bytes) -> Behaviour:
    """A body that never ends, as fast as the client reads it."""

    async def b(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head)
        while True:
            writer.write(chunk)
            await writer.drain()

    return b


def reset_after(data: bytes) -> Behaviour:
    """Write `data`, then abort the connection with a TCP RST."""

    async def b(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    return b


def response(body: bytes, status: int = 200, framing: str = "length", extra: bytes = b"") -> bytes:
    """A well-formed HTTP/1.1 response; `framing`: length | chunked | close."""
    head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n".encode() + extra
    if framing == "length":
        return head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    if framing == "chunked":
        chunks = b"".join(
            f"{len(body[i : i + 7]):x}\r\n".encode() + body[i : i + 7] + b"\r\n"
            for i in range(0, len(body), 7)
        )
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    return head + b"Connection: close\r\n\r\n" + body


def generate_answer(**meta: Any) -> dict[str, Any]:
    """A valid /generate answer of SGLang with EAGLE on; `meta` overrides meta_info fields."""
    info: dict[str, Any] = {
        "id": "0a1b",
        "finish_reason": {"type": "length", "length": MAX_TOKENS},
        "prompt_tokens": 6,
        "completion_tokens": MAX_TOKENS,
        "e2e_latency": 0.05,
        "spec_verify_ct": 3,
        "spec_accept_length": 2.67,
    }
    info.update(meta)
    return {"text": " Hello" * MAX_TOKENS, "output_ids": list(range(MAX_TOKENS)), "meta_info": info}


CHAT_ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello"},
            "finish_reason": "length",
        }
    ],
    "usage": {"prompt_tokens": 9, "completion_tokens": MAX_TOKENS, "total_tokens": 17},
}
VALID = json.dumps(generate_answer()).encode()


async def ask(
    server: Server,
    cfg: ProbeConfig = GENERATE,
    client: httpx.AsyncClient | None = None,
    speculative: bool = True,
) -> tuple[ProbeResult, float]:
    """One probe against `server`: (result, wall seconds). Fails the test if probe() raises."""
    own = client is None
    c = client or httpx.AsyncClient(trust_env=False)
    start = time.monotonic()
    try:
        result = await probe(c, server.url, cfg, speculative, timeout=cfg.timeout)
    finally:
        took = time.monotonic() - start
        if own:
            await c.aclose()
    assert isinstance(result, ProbeResult)
    assert took <= cfg.timeout + MARGIN_S, f"the probe took {took:.2f} s ({result})"
    assert result.latency_s <= cfg.timeout + MARGIN_S
    return result, took


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- fixed scenarios


def test_a_valid_answer_passes_in_every_framing() -> None:
    """The control: the server and the client work, so the failures below mean something."""

    async def go() -> None:
        for framing in ("length", "chunked", "close"):
            async with Server(send(response(VALID, framing=framing))) as s:
                result, _ = await ask(s)
                assert result.ok, (framing, result)
        async with Server(send(response(json.dumps(CHAT_ANSWER).encode()))) as s:
            result, _ = await ask(s, CHAT)
            assert result.ok, result
        # A valid answer trickled well within the timeout is still valid.
        async with Server(trickle(response(VALID), 0.002, step=64)) as s:
            result, _ = await ask(s)
            assert result.ok, result

    run(go())


_HEAD_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"

BROKEN: dict[str, Behaviour] = {
    "closed at once": send(b""),
    "not HTTP": send(b"hello, this is not HTTP\r\n\r\n"),
    "binary noise": send(bytes(range(256)) * 8),
    "status line only": send(b"HTTP/1.1 200 OK\r\n"),
    "status 2000": send(b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\n{}"),
    "HTTP/9.9": send(b"HTTP/9.9 200 OK\r\nContent-Length: 2\r\n\r\n{}"),
    "content-length abc": send(_HEAD_OK + b"Content-Length: abc\r\n\r\n" + VALID),
    "content-length -1": send(_HEAD_OK + b"Content-Length: -1\r\n\r\n" + VALID),
    "two content-lengths": send(
        _HEAD_OK + f"Content-Length: {len(VALID)}\r\nContent-Length: 3\r\n\r\n".encode() + VALID
    ),
    "bad chunk size": send(_HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"),
    "chunked, never terminated": send(
        _HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(VALID):x}\r\n".encode() + VALID
    ),
    "truncated body, then close": send(
        _HEAD_OK + f"Content-Length: {len(VALID)}\r\n\r\n".encode() + VALID[: len(VALID) // 2]
    ),
    "truncated body, then RST": reset_after(
        _HEAD_OK + f"Content-Length: {len(VALID)}\r\n\r\n".encode() + VALID[:40]
    ),
    "header line of 256 KiB": send(
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (256 << 10) + b"\r\n\r\n"
    ),
    "100 Continue, then nothing": send_then_hang(b"HTTP/1.1 100 Continue\r\n\r\n"),
    "101 Switching Protocols": send(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"),
    "gzip-encoded valid answer": send(
        response(gzip.compress(VALID), extra=b"Content-Encoding: gzip\r\n")
    ),
    "no answer at all": send_then_hang(b""),
    "headers, then silence": send_then_hang(_HEAD_OK + b"Content-Length: 500\r\n\r\n"),
    "half a header, then silence": send_then_hang(b"HTTP/1.1 200 OK\r\nContent-Le"),
    "slow-loris headers": trickle(response(VALID), 0.05),
    "slow-loris body": trickle(response(VALID), 0.02, step=4),
    "chunks of whitespace forever": trickle(
        _HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n" + b"1\r\n \r\n" * 10_000, 0.01, step=6
    ),
    "huge body with a length": send(response(b" " * (MAX_BODY_BYTES + 1) + VALID)),
    "huge chunked body": send(response(b" " * (2 * MAX_BODY_BYTES) + VALID, framing="chunked")),
    "endless close-delimited body": endless(_HEAD_OK + b"Connection: close\r\n\r\n", b"[" * 65536),
    "endless chunked body": endless(
        _HEAD_OK + b"Transfer-Encoding: chunked\r\n\r\n", b"4000\r\n" + b" " * 0x4000 + b"\r\n"
    ),
    "HTTP 500 with a valid body": send(response(VALID, status=500)),
    "HTTP 503 with a valid body": send(response(VALID, status=503)),
    "HTTP 204": send(b"HTTP/1.1 204 No Content\r\n\r\n"),
    "redirect to a valid answer": send(
        b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n"
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_answer_fails_cleanly(name: str) -> None:
    async def go() -> ProbeResult:
        async with Server(BROKEN[name]) as s:
            result, _ = await ask(s)
            return result

    with trial("malformed answers", "fixed: broken HTTP, trickles, huge bodies") as t:
        result = run(go())
        t.false_ready = int(result.ok)
        assert not result.ok, result
        assert result.reason != "ok" and result.error
        t.recovered = True


def test_one_client_survives_every_broken_answer() -> None:
    """The daemon keeps one HTTP client for all probes: after all of the above on that client,
    a valid answer still passes (no poisoned connection pool, no stuck state)."""

    async def go() -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            for name in sorted(BROKEN):
                async with Server(BROKEN[name]) as s:
                    result, _ = await ask(s, client=client)
                    assert not result.ok, name
                    async with Server(send(response(VALID))) as good:
                        result, _ = await ask(good, client=client)
                        assert result.ok, (name, result)

    with trial("malformed answers", "fixed: broken HTTP, trickles, huge bodies") as t:
        run(go())
        t.recovered = True


# ---------------------------------------------------------------------- hypothesis-driven


@fuzz_settings(40)
@given(data=st.binary(max_size=4096))
def test_arbitrary_bytes_never_pass(data: bytes) -> None:
    async def go() -> ProbeResult:
        async with Server(send(data)) as s:
            return (await ask(s))[0]

    with trial("malformed answers", "hypothesis: arbitrary bytes as the whole answer") as t:
        result = run(go())
        t.false_ready = int(result.ok)
        assert not result.ok
        t.recovered = True


@fuzz_settings(40)
@given(
    body=st.binary(max_size=2048),
    framing=st.sampled_from(["length", "chunked", "close"]),
    status=st.sampled_from([200, 200, 200, 201, 404, 500, 503]),
)
def test_arbitrary_bodies_agree_with_judge(body: bytes, framing: str, status: int) -> None:
    """Whatever the framing, the network layer hands judge() exactly the body that was sent."""

    async def go() -> ProbeResult:
        async with Server(send(response(body, status=status, framing=framing))) as s:
            return (await ask(s))[0]

    with trial("malformed answers", "hypothesis: arbitrary bodies, any framing") as t:
        result = run(go())
        t.false_ready = int(result.ok)
        verdict = judge("generate", status, body, GENERATE, True)
        assert result.ok == verdict.ok
        assert not result.ok
        t.recovered = True


# Field values that keep an answer valid, and values that break it.
_ABSENT = object()
GOOD_TEXT = [" Hello" * 8, "", "é\u2028\x00"]
BAD_TEXT = [None, 8, ["Hello"], {"t": 1}, _ABSENT]
GOOD_TOKENS = [8, 8.0]
BAD_TOKENS = [0, 1, 7, 9, -8, True, "8", None, [8], 8.5, 1e300, _ABSENT]
GOOD_VERIFY = [1, 3, 3.0, 999]
BAD_VERIFY = [0, -1, None, "3", True, False, 0.5, _ABSENT]
FINISH = [{"type": "length", "length": 8}, "length", {"type": "stop"}, "stop", None, 5, _ABSENT]


def _put(d: dict[str, Any], key: str, value: Any) -> None:
    if value is not _ABSENT:
        d[key] = value


@st.composite
def mutated_answers(draw: st.DrawFn) -> tuple[Any, bool]:
    """(a /generate answer, whether it is valid): each field drawn from good or bad values."""
    text_ok = draw(st.booleans())
    tokens_ok = draw(st.booleans())
    verify_ok = draw(st.booleans())
    meta_kind = draw(st.sampled_from(["dict", "dict", "dict", "list", "string", "absent"]))
    text = draw(st.sampled_from(GOOD_TEXT if text_ok else BAD_TEXT))
    tokens = draw(st.sampled_from(GOOD_TOKENS if tokens_ok else BAD_TOKENS))
    verify = draw(st.sampled_from(GOOD_VERIFY if verify_ok else BAD_VERIFY))
    finish = draw(st.sampled_from(FINISH))
    meta: dict[str, Any] = {"prompt_tokens": 6}
    _put(meta, "completion_tokens", tokens)
    _put(meta, "spec_verify_ct", verify)
    _put(meta, "finish_reason", finish)
    doc: dict[str, Any] = {"output_ids": [1, 2]}
    _put(doc, "text", text)
    if meta_kind == "dict":
        doc["meta_info"] = meta
    elif meta_kind != "absent":
        doc["meta_info"] = [meta] if meta_kind == "list" else json.dumps(meta)
    extra = draw(st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
    for k, v in extra.items():
        doc.setdefault(k, v)
    top = draw(st.sampled_from(["object", "object", "object", "list", "null"]))
    if top == "list":
        return [doc], False
    if top == "null":
        return None, False
    # A stop after at least two tokens is a legitimate early end.
    stopped = finish in ("stop", {"type": "stop"})
    early_stop = (
        stopped
        and isinstance(tokens, int | float)
        and not isinstance(tokens, bool)
        and tokens >= 2
        and float(tokens).is_integer()
    )
    valid = text_ok and meta_kind == "dict" and (tokens_ok or early_stop) and verify_ok
    return doc, valid


@fuzz_settings(60)
@given(
    answer=mutated_answers(),
    framing=st.sampled_from(["length", "chunked", "close"]),
    cut=st.none() | st.floats(0.0, 0.999),
)
def test_wrong_types_and_truncations_never_pass(
    answer: tuple[Any, bool], framing: str, cut: float | None
) -> None:
    """Passes exactly when the answer is a valid 8-token EAGLE decode, whole and on time."""
    doc, valid = answer
    body = json.dumps(doc).encode()
    if cut is not None:
        body = body[: int(len(body) * cut)]  # truncated JSON, correctly framed
        valid = False

    async def go() -> ProbeResult:
        async with Server(send(response(body, framing=framing))) as s:
            return (await ask(s))[0]

    with trial("malformed answers", "hypothesis: wrong types, missing fields, truncated JSON") as t:
        result = run(go())
        t.false_ready = int(result.ok and not valid)
        assert result.ok == valid, (doc, body[:200], result)
        t.recovered = True


@fuzz_settings(15)
@given(cut=st.integers(0, len(response(VALID)) - 1), then=st.sampled_from(["close", "rst", "hang"]))
def test_an_answer_cut_anywhere_never_passes(cut: int, then: str) -> None:
    """The connection ends (or goes silent) part-way through a valid answer."""
    data = response(VALID)[:cut]
    behaviour = {"close": send, "rst": reset_after, "hang": send_then_hang}[then](data)

    async def go() -> ProbeResult:
        async with Server(behaviour) as s:
            return (await ask(s))[0]

    with trial("malformed answers", "hypothesis: answer cut anywhere (close, RST, silence)") as t:
        result = run(go())
        t.false_ready = int(result.ok)
        assert not result.ok
        if then == "hang":
            assert result.reason == "timeout"
        t.recovered = True


@fuzz_settings(6)
@given(noise=st.lists(st.sampled_from(sorted(BROKEN)), min_size=1, max_size=4))
def test_sequences_of_broken_answers_then_a_good_one(noise: list[str]) -> None:
    """A stream of bad answers on one client, as the daemon sees them: the next good one passes."""

    async def go() -> None:
        answers = (*(BROKEN[n] for n in noise), send(response(VALID)))
        async with httpx.AsyncClient(trust_env=False) as client, Server(*answers) as s:
            for name in noise:
                result, _ = await ask(s, client=client)
                assert not result.ok, name
            result, _ = await ask(s, client=client)
            assert result.ok, result

    with trial("malformed answers", "hypothesis: broken answers in a row, then a good one") as t:
        run(go())
        t.recovered = True


# --------------------------------------------------------------------------- /server_info


@pytest.mark.parametrize(
    "behaviour",
    [
        send(response(b"[" * 16000)),  # RecursionError inside json.loads
        send(response(b'{"a":' * 3000)),
        send(response(b"\xff\xfe not utf-8")),
        send(response(b"9" * 5000)),  # over the integer digit limit
        send(response(b"[1, 2]")),  # JSON, not an object
        send(response(b"{" + b" " * (endpoints.MAX_INFO_BYTES + 10) + b"}")),  # over the cap
        endless(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"1000\r\n" + b" " * 4096 + b"\r\n",
        ),
        send(response(gzip.compress(b'{"tp_size": 2}'), extra=b"Content-Encoding: gzip\r\n")),
        reset_after(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"),
    ],
    ids=[
        "brackets",
        "objects",
        "not-utf8",
        "huge-int",
        "list",
        "over-cap",
        "endless",
        "gzip",
        "reset",
    ],
)
def test_server_info_treats_every_bad_answer_as_none(behaviour: Behaviour) -> None:
    """The intent check's fetch: every undecodable, oversized or encoded answer is "no
    /server_info", never an exception (which would end the daemon's task and stop SGLang)."""

    async def go() -> Any:
        async with Server(behaviour) as server:
            cfg: Any = SimpleNamespace(sglang=SimpleNamespace(host="127.0.0.1", port=server.port))
            async with httpx.AsyncClient(trust_env=False) as client:
                return await probing.server_info(client, cfg)

    assert run(go()) is None


def test_server_info_reads_a_good_answer() -> None:
    async def go() -> Any:
        async with Server(send(response(b'{"tp_size": 2}'))) as server:
            cfg: Any = SimpleNamespace(sglang=SimpleNamespace(host="127.0.0.1", port=server.port))
            async with httpx.AsyncClient(trust_env=False) as client:
                return await probing.server_info(client, cfg)

    assert run(go()) == {"tp_size": 2}
