"""SGLang's output lines: counted, scanned, forwarded to our log under a rate limit.

The process layer (`process.pipes._Pump`) delivers lines here. Each line goes to the `LogScanner`
(ready / fatal verdicts, the bounded tail for /status) and, at most FORWARD_PER_SECOND a second,
to the daemon's own log. A verdict becomes an event (`ReadyLine`, `FatalLog`) for the machine,
which drops it if it belongs to an earlier launch.

A traceback is one log record over many lines: a fatal pattern at its head waits for the
exception line that ends it, or FATAL_SETTLE_S, whichever comes first, so the restart's log
tail holds the line on-call needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from supervisor import log, redact
from supervisor.config import Config
from supervisor.core.machine import Event, FatalLog, ReadyLine
from supervisor.metrics import Metrics
from supervisor.sglang.logscan import LogScanner, Stream, guess_level

FATAL_SETTLE_S = 1.0
# Under a log flood, forward at most this many SGLang lines a second to our own log; every line
# is still counted, scanned for fatal patterns and kept in the tail.
FORWARD_PER_SECOND = 2000
FORWARD_BURST = 500


class LogPump:
    def __init__(
        self,
        cfg: Config,
        metrics: Metrics,
        clock: Callable[[], float],
        emit: Callable[[Event], None],
        on_line: Callable[[str, float], None] | None = None,
        own_request: Callable[[str], bool] = lambda line: False,
    ) -> None:
        self.metrics = metrics
        # SGLang's access line for one of the daemon's own requests (OwnPorts.ours): debug.
        self.own_request = own_request
        # Every line with the time it was read (the load timeline, recorder.line).
        self.on_line = on_line
        self.clock = clock
        self.emit = emit
        self.log = log.get()
        self.sglog = log.get("sglang")
        self.scanner = LogScanner(cfg.logs.fatal_patterns, cfg.logs.tail_lines)
        self._forward = (float(FORWARD_BURST), clock())
        self._suppressed = 0
        self._suppressed_since = 0.0
        self._pending_launch: int | None = None  # the launch whose traceback awaits its end

    def reconfigure(self, cfg: Config) -> None:
        """A reloaded configuration: new fatal patterns and tail length. What the running launch
        printed stays in the tail: a reload that relaunches nothing (or not yet) must not take
        the lines before a later crash out of its restart record and incident."""
        self.scanner = self.scanner.reconfigured(cfg.logs.fatal_patterns, cfg.logs.tail_lines)

    def new_launch(self) -> None:
        self.scanner.reset()
        self._pending_launch = None

    def tail(self) -> list[str]:
        return self.scanner.tail()

    def lines(self, launch: int, stream: Stream, lines: list[str]) -> None:
        self.metrics.log_lines.labels(stream.value).inc(len(lines))
        # Before anything keeps or forwards them: SGLang logs its server arguments, the API
        # key with them (supervisor/redact.py).
        lines = [redact.line(line) for line in lines]
        now = self.clock()
        # A token bucket refilled continuously: forwarding is spread over the second instead
        # of one burst at its start, during which SGLang's pipe would fill.
        tokens, last = self._forward
        tokens = min(FORWARD_BURST, tokens + (now - last) * FORWARD_PER_SECOND)
        if self._suppressed and now - self._suppressed_since >= 1.0:
            self.log.warning(
                "sglang log flood: lines not forwarded (still scanned)",
                suppressed=self._suppressed,
            )
            self.metrics.log_suppressed.inc(self._suppressed)
            self._suppressed = 0
        on_line = self.on_line
        for line in lines:
            verdict = self.scanner.feed(line)
            if on_line is not None:
                on_line(line, now)
            if tokens >= 1.0:
                tokens -= 1.0
                level = guess_level(line)
                if level == "info" and self.own_request(line):
                    level = "debug"
                getattr(self.sglog, level)(line, source="sglang", stream=stream.value)
            else:
                if not self._suppressed:
                    self._suppressed_since = now
                self._suppressed += 1
            if verdict.ready:
                self.emit(ReadyLine(launch))
            elif verdict.fatal:
                self.emit(FatalLog(launch, self.scanner.evidence[:300]))
            elif verdict.fatal_pending:
                self._pending_launch = launch
                asyncio.get_running_loop().call_later(FATAL_SETTLE_S, self._settle, launch)
        self._forward = (tokens, now)

    def _settle(self, launch: int) -> None:
        # The exception line did not come: the traceback's head is the evidence. A launch that
        # is no longer current is dropped by the machine.
        fatal = self.settle_now(launch)
        if fatal is not None:
            self.emit(fatal)

    def settle_now(self, launch: int) -> FatalLog | None:
        """The launch's traceback still pending, as a verdict now: its processes died before
        the exception line came (real SGLang kills the group by signal 9 right after logging a
        scheduler's exception, docs/sglang.md). The death must read as that traceback, not as
        a kill by signal 9."""
        if self._pending_launch != launch or not self.scanner.pending:
            return None
        self._pending_launch = None
        if self.scanner.settle() is None:
            return None
        return FatalLog(launch, self.scanner.evidence[:300])
