"""setproctitle, as SGLang's children call it, with what it does to /proc.

SGLang's schedulers call `setproctitle("sglang::scheduler<prefix>")` (prefix `_TP<rank>` only
when tp > 1; sglang/srt/managers/scheduler.py:6294 in 0.5.23) and the detokenizer
`setproctitle("sglang::detokenizer")`. The setproctitle package writes the title over the
process's argv memory and, unless `SPT_NOENV=1` is in the environment, over the environment
block that follows it: /proc/PID/cmdline then reads `sglang::scheduler\\0\\0...` (psutil:
`['sglang::scheduler', '', ...]`) and /proc/PID/environ reads only NUL bytes (psutil: `{}`),
so an inherited marker variable is no longer visible. With `SPT_NOENV=1` only argv is reused
and the environment stays readable.

The real package is used when it is installed; otherwise the same writes are made here with
ctypes over the region the kernel reports in /proc/self/stat (arg_start .. arg_end, and
env_start .. env_end). Python's `os.environ` is a copy made at start-up, so the process itself
still sees its environment, as with setproctitle (which moves environ to the heap first).
"""

from __future__ import annotations

import contextlib
import ctypes
import os

_PR_SET_NAME = 15


def _stat_fields() -> list[int]:
    with open("/proc/self/stat", "rb") as f:
        raw = f.read()
    # Fields after the parenthesised comm, which may itself contain spaces.
    rest = raw[raw.rindex(b")") + 2 :].split()
    return [int(x) if x.lstrip(b"-").isdigit() else 0 for x in rest]


def _emulate(title: str) -> None:
    fields = _stat_fields()
    # proc(5): arg_start is field 48 .. env_end field 51; `rest` starts at field 3.
    arg_start, arg_end, env_start, env_end = fields[45:49]
    end = arg_end if os.environ.get("SPT_NOENV") else max(env_end, arg_end)
    size = end - arg_start
    if arg_start <= 0 or size <= 1:
        return
    data = title.encode()[: size - 1]
    ctypes.memmove(arg_start, data + b"\0" * (size - len(data)), size)
    del env_start


def set_title(title: str) -> None:
    """Set the process title as the setproctitle package does, and the kernel's comm name."""
    try:
        import setproctitle  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        # Not Linux, or /proc unreadable: the title is cosmetic there.
        with contextlib.suppress(OSError, ValueError, IndexError):
            _emulate(title)
    else:
        setproctitle.setproctitle(title)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, title.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
