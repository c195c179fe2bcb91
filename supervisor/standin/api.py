"""The HTTP endpoints, with SGLang's paths and response schemas.

Sources: sglang/srt/entrypoints/http_server.py (routes, health, info endpoints),
sglang/srt/managers/tokenizer_manager.py (`_handle_batch_output`: the /generate `meta_info`),
sglang/srt/entrypoints/openai/protocol.py and serving_chat.py (chat completion schema).
`"stream": true` on /generate answers SGLang's server-sent events (http_server.py:949-981,
docs/sglang.md); on the chat route, and batched prompts, it is not imitated and answers 400.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from supervisor.standin import metrics
from supervisor.standin.args import api_key_of
from supervisor.standin.engine import (
    EOS_TOKEN_ID,
    DecodeError,
    Engine,
    Result,
    completion_words,
    token_id,
)

VERSION = "0.5.23-standin"
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's sampling-params default
CONTEXT_LEN = 262144
MAX_TOTAL_NUM_TOKENS = 1048576

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BadRequest(ValueError):
    pass


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.json_response(payload, status=status)


async def _send(request: web.Request, payload: Any, status: int = 200) -> web.Response:
    """Write the whole response now, so a request only leaves `open_requests` (what a
    SIGTERM drain waits for) once its answer is on the wire."""
    response = _json(payload, status)
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:
        pass  # the client went away; nothing left to answer
    return response


def _int_field(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def _logprobs(result: Result, top: int) -> dict[str, Any]:
    """return_logprob: [logprob, token_id, null] per output token (tokenizer_manager.py
    detokenize_logprob_tokens, 0.5.23), and with top_logprobs_num the top-N per position. The
    stand-in is confident: its token leads the runner-up by 6 nats."""
    ids = [token_id(w) for w in result.words]
    out: dict[str, Any] = {
        "output_token_logprobs": [[-0.01, i, None] for i in ids],
        "output_token_logprobs_length": len(ids),
    }
    if top > 0:
        out["output_top_logprobs"] = [
            [[-0.01, i, None], *[[-6.0 - k, (i + 1 + k) % 32000, None] for k in range(top - 1)]]
            for i in ids
        ]
    return out


def _generate_meta(
    result: Result, logprob_top: int | None = None, metrics_on: bool = False
) -> dict[str, Any]:
    """tokenizer_manager._handle_batch_output's meta_info, the keys kimi-serve reads.
    `logprob_top`: return_logprob was asked for, with that top_logprobs_num; `metrics_on`:
    --enable-metrics (decode_throughput: observability/req_time_stats.py:500-532)."""
    n = result.completion_tokens
    finish: dict[str, Any] = (
        {"type": "stop", "matched": EOS_TOKEN_ID}
        if result.stopped
        else {"type": "length", "length": n}
    )
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": finish,
        "prompt_tokens": result.prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": n,
        "cached_tokens": 0,
    }
    # tokenizer_manager.py:3149-3172: the spec keys exist only when verification ran;
    # without speculative decoding (or with no verify step) they are absent, not 0.
    if result.spec is not None and result.spec.verify_ct:
        spec = result.spec
        meta |= {
            "spec_accept_rate": spec.accept_rate,
            "spec_accept_length": spec.accept_length,
            "spec_num_correct_drafts": spec.accepted_tokens,
            "spec_num_proposed_drafts": spec.draft_tokens,
            "spec_verify_ct": spec.verify_ct,
        }
    meta["e2e_latency"] = result.e2e_latency
    if metrics_on and n > 1 and result.e2e_latency > 0:
        meta["decode_throughput"] = (n - 1) / result.e2e_latency
    if logprob_top is not None:
        meta |= _logprobs(result, logprob_top)
    return meta


def _logprob_top(body: dict[str, Any]) -> int | None:
    if body.get("return_logprob") is not True:
        return None
    top = body.get("top_logprobs_num")
    return top if isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= 20 else 0


class Api:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.args = engine.args
        self.api_key = api_key_of(engine.args)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._access_log, self._auth, self._bad_requests])
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/ready", self.ready)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/metrics", self.metrics)
        r.add_get("/v1/models", self.models)
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/abort_request", self.abort_request)
        return app

    @web.middleware
    async def _access_log(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """uvicorn's access line, written when the response starts (never for a hung one)."""
        peer = request.transport.get_extra_info("peername") if request.transport else None
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "-"
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            self.engine.log.access(where, request.method, request.path_qs, exc.status, exc.reason)
            raise
        self.engine.log.access(
            where, request.method, request.path_qs, response.status, response.reason
        )
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """SGLang's api_key check (srt/utils/auth.py, decide_request_auth, 0.5.23): with a key,
        every request but OPTIONS and the paths starting /health, /ready or /metrics needs
        `Authorization: Bearer <key>` (the scheme in any case), else 401
        {"error": "Unauthorized"}."""
        if self.api_key is None or request.method == "OPTIONS":
            return await handler(request)
        if request.path.startswith(("/health", "/ready", "/metrics")):
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(
            token.encode(), self.api_key.encode()
        ):
            return await handler(request)
        return _json({"error": "Unauthorized"}, status=401)

    @web.middleware
    async def _bad_requests(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            if request.path.startswith("/v1/"):
                # serving_base.create_error_response: the OpenAI error object.
                return _json(
                    {
                        "object": "error",
                        "message": str(exc),
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    },
                    status=400,
                )
            # http_server._create_error_response
            return _json({"error": {"message": str(exc)}}, status=400)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError as exc:
            raise BadRequest(f"request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        if body.get("stream") and request.path != "/generate":
            raise BadRequest("streaming is not supported by the SGLang stand-in")
        self._log_arrival(request, body)
        return body

    def _log_arrival(self, request: web.Request, body: dict[str, Any]) -> None:
        path = self.engine.settings.request_log
        if path is None or request.path != "/generate":
            return
        text = body.get("text")
        line = {"t": time.time(), "text": text[:80] if isinstance(text, str) else None}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    # -- health and info ------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=await self.engine.health())

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.ready else 503)

    async def server_info(self, request: web.Request) -> web.Response:
        engine = self.engine
        return _json(
            {
                **self.args.as_dict(),
                "max_total_num_tokens": MAX_TOTAL_NUM_TOKENS,
                "max_req_input_len": CONTEXT_LEN - 1,
                "internal_states": [
                    {
                        "avg_spec_accept_length": engine.avg_spec_accept_length,
                        "last_gen_throughput": engine.gen_throughput,
                    }
                ],
                "version": engine.settings.version or VERSION,
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.args.model_path,
                "tokenizer_path": self.args.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "kimi_k2",
                "architectures": ["DeepseekV3ForCausalLM"],
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=metrics.render(self.engine).encode(),
            headers={"Content-Type": metrics.CONTENT_TYPE},
        )

    async def models(self, request: web.Request) -> web.Response:
        name = self.args.model_name
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "sglang",
                        "root": name,
                        "max_model_len": CONTEXT_LEN,
                    }
                ],
            }
        )

    # -- decoding -------------------------------------------------------------------------

    async def abort_request(self, request: web.Request) -> web.Response:
        """http_server.abort_request: {"rid": ..., "abort_all": ...} -> 200, empty body."""
        body = await self._body(request)
        rid = body.get("rid")
        self.engine.abort(rid if isinstance(rid, str) else "", bool(body.get("abort_all")))
        return web.Response(status=200)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        text, input_ids = body.get("text"), body.get("input_ids")
        if isinstance(text, str):
            prompt, prompt_tokens = text, max(1, len(text.split()))
        elif isinstance(input_ids, list) and all(isinstance(i, int) for i in input_ids):
            prompt, prompt_tokens = "", max(1, len(input_ids))
        else:
            # io_struct.GenerateReqInput's own message (batched prompts are not imitated).
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise BadRequest("sampling_params must be an object")
        max_new = _int_field(
            sampling.get("max_new_tokens"), "max_new_tokens", DEFAULT_MAX_NEW_TOKENS
        )
        if body.get("stream"):
            return await self._stream(request, body, prompt, prompt_tokens, max_new)
        with self.engine.request(body.get("rid")) as rid:
            try:
                result = await self.engine.decode(rid, prompt, prompt_tokens, max_new)
            except DecodeError as exc:
                return await _send(request, {"error": {"message": str(exc)}}, status=500)
            return await _send(
                request,
                {
                    "text": "".join(f" {w}" for w in result.words),
                    "output_ids": [token_id(w) for w in result.words],
                    "meta_info": _generate_meta(
                        result, _logprob_top(body), self.args.recorded.get("enable_metrics") is True
                    ),
                },
            )

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        prompt: str,
        prompt_tokens: int,
        max_new: int,
    ) -> web.StreamResponse:
        """http_server.py:949-981: `data: <json>\\n\\n` per step, then `data: [DONE]`. Without
        --incremental-streaming-output (the default) every chunk carries the whole text and
        output_ids so far (tokenizer_manager.py:2636-2663); finish_reason is null until the
        last. An error mid-stream is one `data: {"error": ...}` chunk, then [DONE]."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        words = completion_words(prompt, max_new)

        async def send(doc: Any) -> None:
            payload = doc if isinstance(doc, str) else json.dumps(doc)
            await response.write(f"data: {payload}\n\n".encode())

        with self.engine.request(body.get("rid")) as rid:
            await response.prepare(request)

            async def chunk(k: int) -> None:
                meta = {
                    "id": rid,
                    "finish_reason": None,
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": k,
                    "cached_tokens": 0,
                }
                part = words[:k]
                text = "".join(f" {w}" for w in part)
                await send(
                    {"text": text, "output_ids": [token_id(w) for w in part], "meta_info": meta}
                )

            try:
                try:
                    result = await self.engine.decode(
                        rid, prompt, prompt_tokens, max_new, progress=chunk
                    )
                except DecodeError as exc:
                    await send(
                        {
                            "error": {
                                "message": str(exc),
                                "type": "invalid_request_error",
                                "code": 500,
                                "retryable": False,
                            }
                        }
                    )
                else:
                    await send(
                        {
                            "text": "".join(f" {w}" for w in result.words),
                            "output_ids": [token_id(w) for w in result.words],
                            "meta_info": _generate_meta(result),
                        }
                    )
                await send("[DONE]")
                await response.write_eof()
            except ConnectionError:
                pass  # the client went away
        return response

    async def chat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("Messages cannot be empty.")
        texts = [_message_text(m.get("content")) for m in messages if isinstance(m, dict)]
        users = [
            _message_text(m.get("content"))
            for m in messages
            if isinstance(m, dict) and m.get("role") == "user"
        ]
        # The chat template adds a few tokens per message.
        prompt_tokens = sum(len(t.split()) for t in texts) + 3 * len(texts) + 2
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = _int_field(max_tokens, "max_tokens", DEFAULT_MAX_NEW_TOKENS)
        prompt = users[-1] if users else ""
        with self.engine.request(body.get("rid")) as rid:
            try:
                result = await self.engine.decode(rid, prompt, prompt_tokens, max_new)
            except DecodeError as exc:
                error = {
                    "object": "error",
                    "message": str(exc),
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
                return await _send(request, error, status=500)
            return await _send(request, self._chat_response(body, result))

    def _chat_response(self, body: dict[str, Any], result: Result) -> dict[str, Any]:
        text = "".join(f" {w}" for w in result.words)
        content: str | None = text
        reasoning: str | None = None
        # With a reasoning parser (e.g. kimi_k2) an answer cut off by max_tokens while the
        # model is still thinking lands entirely in reasoning_content: judge a probe by
        # usage.completion_tokens, not by content.
        if self.args.recorded.get("reasoning_parser") and result.words:
            content, reasoning = None, text
        n = result.completion_tokens
        return {
            "id": uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.args.model_name,
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
                    "finish_reason": "stop" if result.stopped else "length",
                    "matched_stop": EOS_TOKEN_ID if result.stopped else None,
                }
            ],
            "usage": {
                "prompt_tokens": result.prompt_tokens,
                "total_tokens": result.prompt_tokens + n,
                "completion_tokens": n,
                "prompt_tokens_details": None,
                "reasoning_tokens": n if reasoning is not None else 0,
            },
            "metadata": {"weight_version": "default"},
        }
