"""SGLang's log lines: a bounded tail for `status`, and what a line means for supervision.

Pure: lines in, verdicts out. The process layer feeds it; the daemon acts on the verdicts.
"""

from __future__ import annotations

import importlib
import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# Printed by SGLang's launcher after its own warm-up request succeeded (http_server.py
# `_wait_and_warmup`). A readiness probe is started at once instead of waiting for a poll tick.
READY_LINE = "The server is fired up and ready to roll!"

# A multi-line traceback is logged as one record whose first line carries the fatal pattern and
# whose last line names the exception. Restarting on the first line would cut the log tail before
# the line on-call needs (the incident's `AttributeError: 'EAGLEWorkerV2' ...`), so the verdict
# waits for that line (or a short settle timer in the daemon).
_TRACEBACK_START = re.compile(r"Traceback \(most recent call last\)|hit an exception")
# Python's last traceback line is `Name: message` or `Name` alone: a line that merely starts
# with such a word ("Error handling request from ...", aiohttp's own log) is not one.
_EXCEPTION_LINE = re.compile(
    r"^(?:\[[^\]]*\]\s*)*(?:[A-Za-z_][\w.]*\.)?(?=[A-Z])\w*(?:Error|Exception|Interrupt|Exit|Fault)"
    r"(?::|$)"
)

# SGLang's soft watchdog prints the hard watchdog's text with `soft=True` and only dumps state
# (`utils/watchdog.py:152-163`, 0.5.23): whatever the configured patterns say, it never restarts.
_NEVER_FATAL = re.compile(r"watchdog timeout \(.*\bsoft=True\b")

# (level, substrings one of which must occur, the regex that confirms it). The substring test
# runs first: it is ten times cheaper than a regex that starts with \b, and most lines fail it.
_LEVEL_WORDS = (
    ("critical", ("CRITICAL", "FATAL"), re.compile(r"\b(CRITICAL|FATAL)\b")),
    (
        "error",
        ("ERROR", "Traceback", "Error", "Exception"),
        re.compile(r"\bERROR\b|Traceback \(most recent|^\w*(?:Error|Exception)\b"),
    ),
    ("warning", ("WARN",), re.compile(r"\bWARN(?:ING)?\b")),
    ("debug", ("DEBUG",), re.compile(r"\bDEBUG\b")),
)


# The request ids of kimi-serve's own probes (probe.new_rid). SGLang logs the abort of a timed-out
# probe as an exception ("ValueError: Request is disconnected from the client side (type 3).
# Abort request obj.rid='kimi-serve-liveness-...'"): our doing, never the exception of a crash.
OWN_RID_MARK = "kimi-serve-"


def exception_line(lines: Iterable[str]) -> str | None:
    """The last line that names an exception (a traceback's last line), if any; not the one
    SGLang logs for the abort of one of our own probes."""
    found = None
    for line in lines:
        text = line.strip()
        if _EXCEPTION_LINE.match(text) and f"rid='{OWN_RID_MARK}" not in text:
            found = text
    return found


class Stream(StrEnum):
    STDOUT = "stdout"
    STDERR = "stderr"


def guess_level(line: str) -> str:
    """The level SGLang logged a line at, read from the line itself (default info)."""
    for level, needles, pattern in _LEVEL_WORDS:
        if any(n in line for n in needles) and pattern.search(line):
            return level
    return "info"


@dataclass(frozen=True)
class LineVerdict:
    ready: bool = False
    fatal: str | None = None  # the pattern that matched, once the record is complete
    fatal_pending: bool = False  # a traceback started; the daemon arms a settle timer


NOTHING = LineVerdict()


# ------------------------------------------------------------------ the fatal patterns' literals

# Every SGLang line is held against every fatal pattern; a regex search costs over a
# microsecond a pattern on a 150-byte line, most of the pump's time in a log flood. A pattern
# can match only a line that holds one of its required literals (`required_literals`), and a
# substring test is ten times cheaper: the search runs only on a line that passes it.
MIN_LITERAL = 3

try:  # CPython's own regex parser; without it every line is searched (slower, the same verdicts)
    _sre: Any = importlib.import_module("re._parser")
except ImportError:  # pragma: no cover - other interpreters
    _sre = None


class _Unknown(Exception):
    pass


def required_literals(pattern: str) -> tuple[str, ...] | None:
    """Strings one of which every match of `pattern` contains, or None when that cannot be told
    (case-insensitive parts, no literal of MIN_LITERAL characters, an unparsable pattern)."""
    if _sre is None:
        return None
    try:
        parsed = _sre.parse(pattern)
        if parsed.state.flags & re.IGNORECASE:
            return None
        return _best(_required(list(parsed)))
    except (_Unknown, re.error, RecursionError, AttributeError, TypeError, ValueError):
        return None


def _required(items: Sequence[tuple[Any, Any]]) -> list[tuple[str, ...]]:
    """Each entry: one of its strings occurs in every match of the sequence `items`. Only what
    the sequence cannot skip counts: runs of literal characters, groups, alternations whose
    every branch has such a literal; anything optional or repeated is passed over."""
    out: list[tuple[str, ...]] = []
    run: list[str] = []
    for op, av in items:
        if op is _sre.LITERAL:
            run.append(chr(av))
            continue
        if run:
            out.append(("".join(run),))
            run = []
        if op is _sre.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise _Unknown
            out.extend(_required(list(sub)))
        elif op is _sre.BRANCH:
            alternatives: list[str] = []
            for branch in av[1]:
                best = _best(_required(list(branch)))
                if best is None:
                    break
                alternatives.extend(best)
            else:
                out.append(tuple(alternatives))
    if run:
        out.append(("".join(run),))
    return out


def _best(options: list[tuple[str, ...]]) -> tuple[str, ...] | None:
    """The option whose shortest string is longest (the rarest in a line), if long enough."""
    usable = [o for o in options if o and min(map(len, o)) >= MIN_LITERAL]
    return max(usable, key=lambda o: min(map(len, o)), default=None)


class LogScanner:
    """Keeps the last `tail_lines` lines and reports ready / fatal lines."""

    def __init__(self, fatal_patterns: Iterable[str], tail_lines: int) -> None:
        self._fatal = [(re.compile(p), required_literals(p)) for p in fatal_patterns]
        self._tail: deque[str] = deque(maxlen=tail_lines)
        self._pending: str | None = None  # fatal pattern seen at the head of a traceback
        self._head = ""  # that traceback's first line
        # The line that proves the last fatal verdict (the exception line of a traceback), for
        # the restart's detail: what on-call reads first.
        self.evidence = ""
        self.lines = 0

    def feed(self, line: str) -> LineVerdict:
        self._tail.append(line)
        self.lines += 1
        if self._pending is not None:
            if _EXCEPTION_LINE.match(line.strip()):
                fatal, self._pending = self._pending, None
                self.evidence = line.strip()
                return LineVerdict(fatal=fatal)
            return NOTHING
        if READY_LINE in line:
            return LineVerdict(ready=True)
        if "soft=True" in line and _NEVER_FATAL.search(line):
            return NOTHING
        for pattern, literals in self._fatal:
            if literals is not None:
                for literal in literals:  # a loop, not any(): this runs for every line
                    if literal in line:
                        break
                else:
                    continue
            if pattern.search(line):
                if _TRACEBACK_START.search(line):
                    self._pending = pattern.pattern
                    self._head = line.strip()
                    return LineVerdict(fatal_pending=True)
                self.evidence = line.strip()
                return LineVerdict(fatal=pattern.pattern)
        return NOTHING

    @property
    def pending(self) -> bool:
        """A traceback has started and its exception line has not arrived yet."""
        return self._pending is not None

    def settle(self) -> str | None:
        """The settle timer ran out: a pending traceback counts as fatal now."""
        fatal, self._pending = self._pending, None
        if fatal is not None:
            self.evidence = self._head
        return fatal

    def tail(self) -> list[str]:
        return list(self._tail)

    def reconfigured(self, fatal_patterns: Iterable[str], tail_lines: int) -> LogScanner:
        """A scanner with a reloaded configuration that goes on with this launch: its tail (the
        next restart's `log_tail`), a traceback still waiting for its last line, the evidence."""
        out = LogScanner(fatal_patterns, tail_lines)
        out._tail.extend(self._tail)
        out._pending, out._head = self._pending, self._head
        out.evidence, out.lines = self.evidence, self.lines
        return out

    def reset(self) -> None:
        """A new launch: its tail starts empty, so a restart's tail is that launch's alone."""
        self._pending = None
        self._tail.clear()
