"""Decoding what a peer, SGLang or a router sent: every failure is a bad answer, never an
exception that could end a task.

`json.loads` raises more than ValueError on hostile input: 16,000 `[` (under any sane size cap)
exhaust the parser's recursion limit (RecursionError on Python 3.11), a body that is not UTF-8
raises UnicodeDecodeError (a ValueError), a huge number raises ValueError, memory can run out.
A caller that catches only ValueError lets the rest end its task; the daemon stops SGLang when
a task ends with an exception (daemon._task_done). So every untrusted JSON goes through `loads`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx


class BadAnswer(ValueError):
    """An answer that cannot be decoded; the message says why in a few words."""


def loads(body: bytes | str) -> Any:
    """JSON from an untrusted source, or BadAnswer (a ValueError) for anything else."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError, TypeError, MemoryError) as exc:
        what = "nested too deep" if isinstance(exc, RecursionError) else type(exc).__name__
        raise BadAnswer(f"not JSON ({what})") from None


async def read_capped(response: httpx.Response, limit: int) -> bytes:
    """The raw body of a streamed answer, at most `limit` bytes: BadAnswer beyond (declared or
    sent), or for a compressed one, which could inflate without bound."""
    encoding = response.headers.get("content-encoding", "identity")
    if encoding != "identity":
        raise BadAnswer(f"answer encoded as {encoding!r}")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadAnswer(f"answer of {declared} bytes (at most {limit} read)")
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > limit:
            raise BadAnswer(f"answer larger than {limit} bytes")
    return bytes(body)
