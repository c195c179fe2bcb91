"""The canary's request to SGLang: one greedy /generate with each position's top-2 logprobs,
as the daemon's canary, its known answers and `kimi-serve canary try` send it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from supervisor import untrusted
from supervisor.quality import Answer, parse_answer
from supervisor.sglang import endpoints
from supervisor.sglang.probe import new_rid


def canary_request(prompt: str, max_tokens: int, rid: str) -> dict[str, Any]:
    """Greedy, with each position's top-2 logprobs (GenerateReqInput.return_logprob,
    top_logprobs_num: managers/io_struct.py, 0.5.23)."""
    return {
        "text": prompt,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "stream": False,
        "rid": rid,
    }


async def ask(
    http: httpx.AsyncClient,
    base: str,
    prompt: str,
    max_tokens: int,
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Answer | str, float]:
    """One canary request: (the answer or why there is none, seconds it took). A timed-out
    request is aborted inside SGLang, as a probe is."""
    rid = new_rid("canary")
    start = clock()
    body = canary_request(prompt, max_tokens, rid)
    try:
        status, raw = await endpoints.post_generate(http, base, "/generate", body, timeout)
    except TimeoutError:
        await endpoints.abort(http, base, rid, min(2.0, timeout))
        return f"no canary answer within {timeout:g}s", clock() - start
    except untrusted.BadAnswer as exc:
        return f"canary answer: {exc}", clock() - start
    except (httpx.HTTPError, OSError, ValueError) as exc:
        return f"canary request failed: {exc or type(exc).__name__}", clock() - start
    took = clock() - start
    if status != 200:
        return f"canary answer HTTP {status}", took
    return parse_answer(raw, took), took
