"""The log scanner: SGLang's lines in, ready / fatal verdicts and a bounded tail out.

The lines are SGLang's own shapes: `[time TPn] message` from the schedulers, tracebacks logged
as one record over many lines (`Scheduler hit an exception: Traceback ...`), and client-request
tracebacks from the tokenizer manager that do not mean the server is broken.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.config import DEFAULT_FATAL_PATTERNS
from supervisor.sglang.logscan import (
    NOTHING,
    READY_LINE,
    LineVerdict,
    LogScanner,
    Stream,
    exception_line,
    guess_level,
    required_literals,
)
from supervisor.sglang.probe import new_rid

SCHEDULER_EXCEPTION = DEFAULT_FATAL_PATTERNS[0]

# The seed incident: the EAGLE v2 worker dies on its first decode.
INCIDENT = [
    "[2026-11-30 01:02:03 TP0] Scheduler hit an exception: Traceback (most recent call last):",
    '  File "/opt/sglang/venv/lib/python3.12/site-packages/sglang/srt/managers/scheduler.py",'
    " line 2954, in run_scheduler_process",
    "    scheduler.event_loop_overlap()",
    '  File "/opt/sglang/venv/lib/python3.12/site-packages/sglang/srt/speculative/'
    'eagle_worker_v2.py", line 702, in forward_batch_generation',
    "    if batch.batch_size() > self.spec_disable_batch_threshold:",
    "                            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    "AttributeError: 'EAGLEWorkerV2' object has no attribute 'spec_disable_batch_threshold'",
]

# A rejected request: the tokenizer manager logs a traceback, the server keeps serving.
CLIENT_TRACEBACK = [
    "[2026-11-30 01:05:00] Traceback (most recent call last):",
    '  File "/opt/sglang/venv/lib/python3.12/site-packages/sglang/srt/managers/'
    'tokenizer_manager.py", line 612, in _tokenize_one_request',
    "    raise ValueError(error_msg)",
    "ValueError: The input (140001 tokens) is longer than the model's context length "
    "(131072 tokens).",
    '[2026-11-30 01:05:00] INFO:     127.0.0.1:51234 - "POST /generate HTTP/1.1" 400 Bad Request',
]


def scanner(tail_lines: int = 200) -> LogScanner:
    return LogScanner(DEFAULT_FATAL_PATTERNS, tail_lines)


def feed_all(s: LogScanner, lines: list[str]) -> list[LineVerdict]:
    return [s.feed(line) for line in lines]


# ------------------------------------------------------------------------------ ready


@pytest.mark.parametrize(
    "line",
    [
        READY_LINE,
        f"[2026-11-30 01:12:44] {READY_LINE}",
        f"[2026-11-30 01:12:44] {READY_LINE} To reduce the log length, set --log-level warning.",
    ],
)
def test_ready_line(line: str) -> None:
    assert scanner().feed(line) == LineVerdict(ready=True)


@pytest.mark.parametrize(
    "line",
    [
        "[2026-11-30 01:02:03] The server is fired up",
        "[2026-11-30 01:02:03] Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)",
        '[2026-11-30 01:02:03] INFO:     127.0.0.1:40000 - "GET /health HTTP/1.1" 200 OK',
        "[2026-11-30 01:02:03 TP0] Load weight end. type=DeepseekV3ForCausalLM, mem usage=68 GB",
        "[2026-11-30 01:02:03 TP0] Capture cuda graph end. Time elapsed: 41.2 s.",
        "",
    ],
)
def test_ordinary_lines_mean_nothing(line: str) -> None:
    assert scanner().feed(line) is NOTHING


# ------------------------------------------------------------------------------ fatal


@pytest.mark.parametrize(
    ("line", "pattern"),
    [
        (
            "[2026-11-30 01:02:03 TP3] Scheduler watchdog timeout (self.watchdog_timeout=300, "
            "self.soft=False)",
            DEFAULT_FATAL_PATTERNS[1],
        ),
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a "
            "total capacity of 139.81 GiB of which 1.12 GiB is free.",
            DEFAULT_FATAL_PATTERNS[2],
        ),
        (
            "RuntimeError: CUDA error: out of memory",
            DEFAULT_FATAL_PATTERNS[2],
        ),
        (
            "RuntimeError: CUDA error: an illegal memory access was encountered",
            DEFAULT_FATAL_PATTERNS[3],
        ),
        (
            "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
            "NCCLUtils.hpp:317, unhandled cuda error, NCCL version 2.27.3",
            DEFAULT_FATAL_PATTERNS[4],
        ),
        (
            "[2026-11-30 01:02:03] ncclUnhandledCudaError: Call to CUDA function failed.",
            DEFAULT_FATAL_PATTERNS[4],
        ),
        (
            "[2026-11-30 01:11:58] Initialization failed. warmup error: Server disconnected",
            DEFAULT_FATAL_PATTERNS[5],
        ),
    ],
)
def test_single_line_fatal_patterns(line: str, pattern: str) -> None:
    s = scanner()
    assert s.feed(line) == LineVerdict(fatal=pattern)
    assert s.settle() is None  # nothing left pending


def test_every_default_pattern_is_exercised() -> None:
    """The table above and the traceback tests between them cover every default pattern."""
    lines = [
        INCIDENT[0],
        "Scheduler watchdog timeout",
        "CUDA out of memory",
        "CUDA error: an illegal memory access",
        "NCCL error",
        "Initialization failed. warmup error",
    ]
    hits = set()
    for line in lines:
        s = scanner()
        verdict = s.feed(line)
        hits.add(verdict.fatal or s.settle())
    assert hits == set(DEFAULT_FATAL_PATTERNS)


def test_the_incident_traceback_waits_for_its_exception_line() -> None:
    s = scanner()
    verdicts = feed_all(s, INCIDENT)
    assert verdicts[0] == LineVerdict(fatal_pending=True)
    assert all(v is NOTHING for v in verdicts[1:-1])
    assert verdicts[-1] == LineVerdict(fatal=SCHEDULER_EXCEPTION)
    assert s.tail() == INCIDENT
    assert s.tail()[-1].startswith("AttributeError: 'EAGLEWorkerV2'")
    assert s.settle() is None  # already reported


@pytest.mark.parametrize("manager", ["Scheduler", "DetokenizerManager", "TokenizerManager"])
def test_every_manager_exception_is_fatal(manager: str) -> None:
    s = scanner()
    head = f"[2026-11-30 01:02:03] {manager} hit an exception: Traceback (most recent call last):"
    assert s.feed(head).fatal_pending
    assert s.feed("KeyError: 'rid'") == LineVerdict(fatal=SCHEDULER_EXCEPTION)


@pytest.mark.parametrize(
    "last",
    [
        "AttributeError: 'EAGLEWorkerV2' object has no attribute 'x'",
        "[2026-11-30 01:02:03 TP0] RuntimeError: CUDA error: device-side assert triggered",
        "torch.OutOfMemoryError: CUDA out of memory.",
        "zmq.error.ZMQError: Address already in use",
        "AssertionError",
        "KeyboardInterrupt",
        "SystemExit: 1",
        "BaseException: x",
    ],
)
def test_exception_lines_end_a_pending_traceback(last: str) -> None:
    s = scanner()
    s.feed(INCIDENT[0])
    assert s.feed(last) == LineVerdict(fatal=SCHEDULER_EXCEPTION)


@pytest.mark.parametrize(
    "line",
    [
        '  File "/x/scheduler.py", line 1, in run',
        "    raise RuntimeError('boom')",
        "    self.spec_disable_batch_threshold",
        "                            ^^^^^^^^^^",
        "",
        "During handling of the above exception, another exception occurred:",
        "[2026-11-30 01:02:03 TP1] Load weight begin.",
        READY_LINE,
        "Scheduler watchdog timeout",  # a second fatal line while the record is still open
        # Words that only look like an exception's name: aiohttp's and a logger's own lines.
        "Error handling request from 127.0.0.1",
        "Exception in ASGI application",
    ],
)
def test_traceback_body_lines_keep_it_pending(line: str) -> None:
    s = scanner()
    s.feed(INCIDENT[0])
    assert s.feed(line) is NOTHING
    assert s.settle() == SCHEDULER_EXCEPTION


def test_a_bare_exception_line_ends_the_traceback() -> None:
    s = scanner()
    s.feed(INCIDENT[0])
    verdict = s.feed("Exception: Capture cuda graph failed: CUDA error: out of memory")
    assert verdict == LineVerdict(fatal=SCHEDULER_EXCEPTION)


def test_settle_reports_a_traceback_whose_last_line_never_came() -> None:
    s = scanner()
    for line in INCIDENT[:-1]:
        s.feed(line)
    assert s.settle() == SCHEDULER_EXCEPTION
    assert s.settle() is None
    # After settling, the next lines are judged afresh.
    assert s.feed("AttributeError: late") is NOTHING
    assert s.feed(READY_LINE).ready


def test_settle_with_nothing_pending() -> None:
    assert scanner().settle() is None


def test_a_fatal_pattern_without_a_traceback_is_fatal_at_once() -> None:
    # A configured pattern: a line that matches it but starts no traceback needs no wait.
    s = LogScanner([r"Scheduler hit an exception|custom fatal"], 10)
    assert s.feed("custom fatal: giving up") == LineVerdict(
        fatal=r"Scheduler hit an exception|custom fatal"
    )


def test_the_first_matching_pattern_is_reported() -> None:
    s = LogScanner(["CUDA", "out of memory"], 10)
    assert s.feed("CUDA out of memory").fatal == "CUDA"


def test_no_patterns_means_nothing_is_fatal() -> None:
    s = LogScanner([], 10)
    assert all(v is NOTHING for v in feed_all(s, INCIDENT))
    assert s.settle() is None


# ------------------------------------------------------------------------------ not fatal


def test_a_client_request_traceback_is_not_fatal_by_default() -> None:
    s = scanner()
    assert all(v is NOTHING for v in feed_all(s, CLIENT_TRACEBACK))
    assert s.settle() is None


@pytest.mark.parametrize(
    "line",
    [
        "[2026-11-30 01:05:00] ERROR:    Exception in ASGI application",
        "[2026-11-30 01:05:00] Abort request 5f1c0e3f",
        "[2026-11-30 01:05:00 TP0] Prefill batch. #new-seq: 1, #new-token: 7, token usage: 0.01",
        "[2026-11-30 01:05:00] WARNING: Invalid HTTP request received.",
        "AttributeError: 'NoneType' object has no attribute 'x'",  # not after a fatal head
    ],
)
def test_other_errors_are_not_fatal(line: str) -> None:
    s = scanner()
    assert s.feed(line) is NOTHING
    assert s.settle() is None


# ------------------------------------------------------------------------------ the tail


def test_tail_is_bounded_and_keeps_the_newest() -> None:
    s = scanner(tail_lines=5)
    for i in range(12):
        s.feed(f"line {i}")
    assert s.tail() == [f"line {i}" for i in range(7, 12)]
    assert s.lines == 12


def test_tail_keeps_the_exception_line_after_a_long_traceback() -> None:
    s = scanner(tail_lines=4)
    frames = [f'  File "/x/m{i}.py", line {i}, in f{i}' for i in range(50)]
    feed_all(s, [INCIDENT[0], *frames, INCIDENT[-1]])
    assert s.tail()[-1] == INCIDENT[-1]
    assert len(s.tail()) == 4


def test_tail_is_a_copy() -> None:
    s = scanner()
    s.feed("a")
    tail = s.tail()
    tail.append("b")
    assert s.tail() == ["a"]


def test_reset_starts_a_new_launch() -> None:
    s = scanner()
    s.feed("old launch")
    s.feed(INCIDENT[0])
    s.reset()
    assert s.tail() == []
    assert s.settle() is None  # the old launch's pending traceback is not the new one's
    assert s.feed(INCIDENT[-1]) is NOTHING
    assert s.tail() == [INCIDENT[-1]]


def test_ready_and_fatal_lines_are_in_the_tail() -> None:
    s = scanner()
    feed_all(s, [READY_LINE, "Scheduler watchdog timeout"])
    assert s.tail() == [READY_LINE, "Scheduler watchdog timeout"]


# ------------------------------------------------------------------------------ levels


@pytest.mark.parametrize(
    ("line", "level"),
    [
        ("[2026-11-30 01:02:03 TP0] Load weight begin. avail mem=139.21 GB", "info"),
        ("[2026-11-30 01:02:03] INFO:     Started server process [4242]", "info"),
        ("[2026-11-30 01:02:03] WARNING: flashinfer allreduce fusion is deprecated", "warning"),
        ("[2026-11-30 01:02:03] WARN something", "warning"),
        ("[2026-11-30 01:02:03] ERROR:    Exception in ASGI application", "error"),
        (INCIDENT[0], "error"),
        ("Traceback (most recent call last):", "error"),
        (INCIDENT[-1], "error"),
        ("ValueError: bad input", "error"),
        ("Exception: Capture cuda graph failed", "error"),
        ("[2026-11-30 01:02:03] CRITICAL: GPU fell off the bus", "critical"),
        ("FATAL: cannot continue", "critical"),
        ("[2026-11-30 01:02:03] DEBUG: scheduler tick", "debug"),
        ("No ERRORS here, WARNINGS neither, and DEBUGGING off", "info"),
        ('  File "/x.py", line 1, in f', "info"),
        ("", "info"),
    ],
)
def test_guess_level(line: str, level: str) -> None:
    assert guess_level(line) == level


def test_critical_wins_over_error() -> None:
    assert guess_level("CRITICAL ERROR") == "critical"


def test_streams() -> None:
    assert [s.value for s in Stream] == ["stdout", "stderr"]


def test_evidence_is_the_exception_line_of_a_traceback() -> None:
    s = scanner()
    for line in INCIDENT:
        s.feed(line)
    assert s.evidence.startswith("AttributeError: 'EAGLEWorkerV2' object has no attribute")


def test_evidence_of_a_single_line_and_of_a_settled_traceback() -> None:
    s = scanner()
    s.feed("[2026-11-30 01:02:03] Scheduler watchdog timeout (self.watchdog_timeout=300)")
    assert "Scheduler watchdog timeout" in s.evidence
    s.feed(INCIDENT[0])
    s.settle()
    assert s.evidence == INCIDENT[0].strip()


# ------------------------------------------------------------------------ soft watchdog


@pytest.mark.parametrize(
    "patterns",
    [DEFAULT_FATAL_PATTERNS, (r"watchdog timeout",), (r"Scheduler watchdog timeout",)],
)
def test_soft_watchdog_never_restarts(patterns: tuple[str, ...]) -> None:
    # utils/watchdog.py (SGLang 0.5.23): the soft watchdog prints the hard one's text with
    # soft=True and only dumps state; the server goes on serving.
    s = LogScanner(patterns, tail_lines=10)
    soft = (
        "[2026-12-01 10:00:00 TP0] Scheduler watchdog timeout "
        "(self.watchdog_timeout=60, self.soft=True)"
    )
    assert s.feed(soft) == NOTHING
    assert s.tail() == [soft]  # still kept for status
    hard = soft.replace("soft=True", "soft=False")
    assert s.feed(hard).fatal is not None


def test_pending_traceback_is_visible() -> None:
    s = LogScanner(DEFAULT_FATAL_PATTERNS, tail_lines=50)
    assert not s.pending
    s.feed(INCIDENT[0])
    assert s.pending
    for line in INCIDENT[1:]:
        s.feed(line)
    assert not s.pending


def test_the_abort_of_our_own_probe_is_not_the_incident_s_exception() -> None:
    # As real SGLang 0.5.23 logs the abort of a timed-out liveness probe
    # (managers/tokenizer_manager.py, _stream_one_response), after the crash's own traceback.
    rid = new_rid("liveness")
    tail = [
        "Traceback (most recent call last):",
        '  File "scheduler.py", line 1, in run',
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "[2026-12-01 13:20:01] ValueError: Request is disconnected from the client side "
        f"(type 3). Abort request obj.rid='{rid}'",
    ]
    assert exception_line(tail) == (
        "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    # Nothing but our abort: no exception to show.
    assert exception_line(tail[-1:]) is None
    # A client's own request id is SGLang's business: shown.
    other = tail[-1].replace(rid, "user-42")
    assert exception_line([other]) == other.strip()


def test_a_line_that_only_starts_like_an_exception_name_is_not_one() -> None:
    # aiohttp logs "Error handling request from ..." before the traceback of a bad request;
    # that traceback's own last line is the exception, not the line before it.
    tail = [
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "Error handling request from 127.0.0.1",
        "Traceback (most recent call last):",
        '  File "web_protocol.py", line 1, in data_received',
    ]
    assert exception_line(tail) == tail[0]


# ------------------------------------------------------------------ the literal prefilter

TRICKY = (
    *DEFAULT_FATAL_PATTERNS,
    r"(?i)cuda out of memory",
    r"a(?i:bc)def",
    r"foo(bar)?baz",
    r"[ab]cdef",
    r"C(?:UDA|uda) error",
    r"\bERROR\b",
    r"x*yzw",
    r"(abc|de)fgh",
    r"(?:abcd|e)xyz",
    r"ab{2,3}cde",
    r"NCCL\s+error",
    r"(?s)abc.def",
    r"warmup (error|failed)|Initialization failed",
    r"(?x) out \s of \s memory",
)


@pytest.mark.parametrize("pattern", TRICKY)
@given(data=st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_match_holds_one_of_the_required_literals(pattern: str, data: st.DataObject) -> None:
    line = data.draw(st.from_regex(pattern))
    assert re.search(pattern, line)
    literals = required_literals(pattern)
    assert literals is None or any(lit in line for lit in literals), (literals, line)


def test_the_default_patterns_have_literals_and_odd_ones_are_searched() -> None:
    assert all(required_literals(p) for p in DEFAULT_FATAL_PATTERNS)
    assert required_literals(r"(Scheduler|TokenizerManager) hit an exception") == (
        " hit an exception",
    )
    assert required_literals(r"CUDA out of memory|torch\.OutOfMemoryError") == (
        "CUDA out of memory",
        "torch.OutOfMemoryError",
    )
    # Case-insensitive, too short, or one branch without a literal: every line is searched.
    for pattern in (r"(?i)oom", r"a(?i:bc)d", r"ab", r"a|bcd", r"x*", r"[", ""):
        assert required_literals(pattern) is None, pattern


def test_a_scanner_with_the_prefilter_gives_the_same_verdicts() -> None:
    lines = [*INCIDENT, "NCCL error: unhandled system error", "all fine", "CUDA error: foo"]
    fast = LogScanner(DEFAULT_FATAL_PATTERNS, 100)
    slow = LogScanner(DEFAULT_FATAL_PATTERNS, 100)
    slow._fatal = [(p, None) for p, _ in slow._fatal]  # every line searched
    assert [fast.feed(x) for x in lines] == [slow.feed(x) for x in lines]
