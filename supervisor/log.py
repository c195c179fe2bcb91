"""Structured logging: one event per line on stdout.

Under systemd stdout is the journal; each line then starts with the sd-daemon priority prefix
(`<3>` error ... `<7>` debug, sd-daemon(3)), so `journalctl -p err -u kimi-serve` works.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, TextIO

import structlog

PRIORITY = {"critical": 2, "error": 3, "warning": 4, "info": 6, "debug": 7}
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def stdout_is_journal(stream: TextIO) -> bool:
    """True when systemd connected this stream to the journal (JOURNAL_STREAM=dev:inode)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def _priority_prefix(_logger: Any, method: str, rendered: str) -> str:
    level = "warning" if method == "warn" else method
    return f"<{PRIORITY.get(level, 6)}>{rendered}"


class SafeStream:
    """The log's stream, never raising: when stdout goes away (the journal restarting, a closed
    pipe, a full disk) the daemon must go on supervising; the lines are lost."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError):  # ValueError: write to a closed file
            return 0

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self.stream.fileno()


def setup(
    fmt: str = "console",
    level: str = "info",
    stream: TextIO | None = None,
    prefix: bool | None = None,
) -> None:
    out = stream or sys.stdout
    use_prefix = stdout_is_journal(out) if prefix is None else prefix
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    if fmt == "json":
        processors.append(structlog.processors.JSONRenderer())
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=out.isatty() and not use_prefix))
    if use_prefix:
        processors.append(_priority_prefix)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=SafeStream(out)),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def get(name: str = "kimi-serve") -> Any:
    return structlog.get_logger(name)
