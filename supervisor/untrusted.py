"""Decoding what a peer, SGLang or a router sent: every failure is a bad answer, never an
exception that could end a task.

`json.loads` raises more than ValueError on hostile input: 16,000 `[` (under any sane size cap)
exhaust the parser's recursion limit (RecursionError on Python 3.11), a body that is not UTF-8
raises UnicodeDecodeError (a ValueError), a huge number raises ValueError, memory can run out.
A caller that catches only ValueError lets the rest end its task; the daemon stops SGLang when
a task ends with an exception (daemon._task_done). So every untrusted JSON goes through `loads`.

`loads` is also total over what JSON allows but no answer of ours holds: Python's decoder takes
`NaN` and `Infinity`, `1e999` (infinite), integers of thousands of digits, and nesting just
under its recursion limit, each of which then breaks the reader further on (`math.isfinite` of
a 401-digit integer raises OverflowError; redaction recursing 700 levels, RecursionError). So
`loads` refuses non-finite numbers, integers beyond 64 bits and documents nested deeper than
MAX_DEPTH: each is a BadAnswer, like any other bad answer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from collections.abc import Iterator
from typing import Any

import httpx

MAX_DEPTH = 32  # no answer or record of ours nests deeper than a few levels
MAX_INT_DIGITS = 20  # 2**64 has 20 digits


class BadAnswer(ValueError):
    """An answer that cannot be decoded; the message says why in a few words."""


def _constant(name: str) -> Any:
    raise BadAnswer(f"not JSON ({name} is no JSON number)")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadAnswer(f"not JSON ({text[:20]} is not a finite number)")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BadAnswer(f"an integer of {len(text)} digits")
    return int(text)


def depth(doc: Any) -> int:
    """How deep a decoded document nests (a scalar: 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        elif not isinstance(value, list):
            continue
        deepest = max(deepest, level + 1)
        stack.extend((v, level + 1) for v in value if isinstance(v, dict | list))
    return deepest


def loads(body: bytes | str, max_depth: int = MAX_DEPTH) -> Any:
    """JSON from an untrusted source, or BadAnswer (a ValueError) for anything else: not
    JSON, a non-finite number, an integer beyond 64 bits, nesting deeper than `max_depth`."""
    try:
        doc = json.loads(body, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except BadAnswer:
        raise
    except (ValueError, RecursionError, TypeError, MemoryError) as exc:
        what = "nested too deep" if isinstance(exc, RecursionError) else type(exc).__name__
        raise BadAnswer(f"not JSON ({what})") from None
    if depth(doc) > max_depth:
        raise BadAnswer(f"nested more than {max_depth} deep")
    return doc


def read_file(name: str | os.PathLike[str], limit: int, dir_fd: int | None = None) -> bytes:
    """A file another user may have planted, read as far as it may be trusted: a regular file,
    not through a link (O_NOFOLLOW: the last part of the name; open its directory the same way,
    `opened_dir`, and pass `dir_fd`), never waiting on a FIFO (O_NONBLOCK), at most `limit` bytes.
    OSError, or BadAnswer (a ValueError) saying why not."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        base = os.path.basename(os.fspath(name))
        if not stat.S_ISREG(st.st_mode):
            raise BadAnswer(f"{base} is not a regular file")
        if st.st_size > limit:
            raise BadAnswer(f"{base} is {st.st_size} bytes, more than {limit} read")
        data = os.read(fd, limit + 1)
        if len(data) > limit:
            raise BadAnswer(f"{base} is more than {limit} bytes")
        return data
    finally:
        os.close(fd)


@contextlib.contextmanager
def opened_dir(path: str | os.PathLike[str]) -> Iterator[int]:
    """A directory's descriptor, not through a link in its last part: what is then opened,
    created or renamed relative to it stays in that directory even if its name is swapped."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


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
