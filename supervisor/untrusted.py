"""Decoding what a peer, SGLang or a router sent: every failure is a bad answer, never an
exception that could end a task.

`json.loads` raises more than ValueError on hostile input: 16,000 `[` (under any sane size cap)
exhaust the parser's recursion limit (RecursionError on Python 3.11), a body that is not UTF-8
raises UnicodeDecodeError (a ValueError), a huge number raises ValueError, memory can run out.
A caller that catches only ValueError lets the rest end its task; the daemon stops SGLang when
a task ends with an exception (daemon._task_done). So every untrusted JSON goes through `loads`.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
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
