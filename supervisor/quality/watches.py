"""Serving quality over time: the watches that turn a launch's probes and lines into verdicts,
decode speed (`SpeedWatch`), speculation's accept length (`SpecWatch`) and the decode path's CUDA
graphs (`GraphWatch`). Pure and total, like the rest of supervisor.quality, which re-exports them.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from supervisor.quality.answers import _num, _whole
from supervisor.sglang import endpoints

# ------------------------------------------------------------------------- decode speed

# slow_decode: the single-stream speed stays below SLOW_RATIO of the reference for SLOW_COUNT
# consecutive idle samples; it clears after SLOW_COUNT consecutive samples above
# RECOVER_RATIO. The reference is the higher of this launch's own first BASELINE_SAMPLES
# (median) and the golden's speed. Samples taken while other requests ran are skipped: a
# loaded server is slower per stream by design.
SLOW_RATIO = 0.5
RECOVER_RATIO = 0.7
SLOW_COUNT = 3
BASELINE_SAMPLES = 3


@dataclass
class SpeedWatch:
    golden_tps: float | None = None
    first: list[float] = field(default_factory=list)
    low: int = 0
    high: int = 0
    slow: bool = False
    last: float | None = None

    @property
    def baseline(self) -> float | None:
        return statistics.median(self.first) if len(self.first) >= BASELINE_SAMPLES else None

    @property
    def reference(self) -> float | None:
        return self._reference(golden=True)

    def _reference(self, golden: bool) -> float | None:
        own = [self.baseline, self.golden_tps if golden else None]
        refs = [r for r in own if r is not None and r > 0]
        return max(refs) if refs else None

    def add(self, tps: float | None, busy: bool, server_measured: bool = True) -> bool:
        """One sample; returns whether `slow` changed. `server_measured`: SGLang's own
        decode_throughput, comparable with the golden's; a wall-clock measure (it includes the
        prefill) is held against this launch's own samples only."""
        if tps is None or not math.isfinite(tps) or tps <= 0:
            return False
        self.last = tps
        if busy:
            return False
        if len(self.first) < BASELINE_SAMPLES:
            self.first.append(tps)
        ref = self._reference(golden=server_measured)
        if ref is None:
            return False
        before = self.slow
        if tps < SLOW_RATIO * ref:
            self.low, self.high = self.low + 1, 0
        elif tps >= RECOVER_RATIO * ref:
            self.low, self.high = 0, self.high + 1
        else:
            self.low = self.high = 0
        if not self.slow and self.low >= SLOW_COUNT:
            self.slow = True
        elif self.slow and self.high >= SLOW_COUNT:
            self.slow = False
        return self.slow != before

    def detail(self) -> str:
        ref = self.reference
        last = f"{self.last:.1f}" if self.last is not None else "?"
        return f"decode {last} tokens/s, reference {ref or 0:.1f} (x{SLOW_RATIO:g} is slow)"


# ------------------------------------------------------------------------- speculation

# A collapse is judged on SGLang's own gauge when it has one (a mean over real traffic), else on
# the mean of the last SPEC_WINDOW probes; SPEC_COUNT consecutive judgements below the floor.
SPEC_WINDOW = 3
SPEC_COUNT = 2


def accept_length(meta: Mapping[str, Any]) -> float | None:
    """Mean accept length of one answer: meta_info.spec_accept_length, else completion tokens
    per verification (managers/tokenizer_manager.py:3149-3172, 0.5.23: present only when
    verification ran)."""
    v = _num(meta.get("spec_accept_length"))
    if v is not None and v > 0:
        return v
    ct, tokens = _whole(meta.get("spec_verify_ct")), _whole(meta.get("completion_tokens"))
    if ct is not None and ct > 0 and tokens is not None and tokens > 0:
        return float(tokens) / float(ct)
    return None


@dataclass
class SpecWatch:
    floor: float
    probes: deque[float] = field(default_factory=lambda: deque(maxlen=SPEC_WINDOW))
    gauge: float | None = None
    low: int = 0
    collapsed: bool = False

    @property
    def value(self) -> float | None:
        if self.gauge is not None and self.gauge > 0:
            return self.gauge
        return statistics.fmean(self.probes) if self.probes else None

    def add(self, probe: float | None, gauge: float | None) -> bool:
        """A probe's accept length and/or the gauge's; returns whether `collapsed` changed."""
        if probe is not None:
            self.probes.append(probe)
        if gauge is not None and math.isfinite(gauge) and gauge > 0:
            self.gauge = gauge
        v = self.value
        if v is None or (probe is None and gauge is None):
            return False
        before = self.collapsed
        self.low = self.low + 1 if v < self.floor else 0
        if self.low >= SPEC_COUNT:
            self.collapsed = True
        elif self.low == 0:
            self.collapsed = False
        return self.collapsed != before

    def detail(self) -> str:
        return f"mean accept length {self.value or 0:.2f} below the floor {self.floor:g}"


SPEC_GAUGE = "sglang:spec_accept_length"  # SGLang's mean accepted draft length (EAGLE)


def parse_gauge(text: str, name: str = SPEC_GAUGE) -> float | None:
    """One gauge from SGLang's /metrics (the mean over its label sets), or None."""
    samples = endpoints.parse_metrics(text)
    return None if samples is None else endpoints.mean(samples, name)


# ------------------------------------------------------------------------- decode path

# scheduler_components/metrics_reporter.py:286-290,1040 (0.5.23): every decode-batch log line
# ends "<device> graph: True|False, gen throughput ...". Only batches of at most
# GRAPH_MAX_RUNNING requests are judged: a larger batch may exceed the captured sizes and run
# without a graph by design.
# Read with substring searches and two anchored matches: every line of a log flood is a decode
# line, and one lazy regex over the whole line cost 4 us of the pump's time per line.
GRAPH_DEVICES = ("cuda", "cpu", "npu", "musa")
_RUNNING = re.compile(r"\s*(\d+)")
_USED = re.compile(r"\s*(True|False)")
GRAPH_MAX_RUNNING = 8
GRAPH_COUNT = 3


def decode_graph(line: str) -> tuple[int, str, bool] | None:
    """(running requests, graph label's device, graph used) of a decode-batch line: "Decode
    batch", then "#running-req: N", then the first "<device> graph: True|False" after it
    (the device a word of its own)."""
    start = line.find("Decode batch")
    if start < 0:
        return None
    at = line.find("#running-req:", start)
    running = None if at < 0 else _RUNNING.match(line, at + len("#running-req:"))
    if running is None:
        return None
    at = line.find(" graph:", running.end())
    while at >= 0:
        for device in GRAPH_DEVICES:
            begin = at - len(device)
            if begin >= 0 and line.startswith(device, begin):
                before = line[begin - 1] if begin > 0 else " "
                used = _USED.match(line, at + len(" graph:"))
                if not (before.isalnum() or before == "_") and used is not None:
                    return int(running.group(1)), device, used.group(1) == "True"
        at = line.find(" graph:", at + 1)
    return None


@dataclass
class GraphWatch:
    """no_cuda_graph: GRAPH_COUNT consecutive small decode batches said `cuda graph: False` on
    a profile that does not disable CUDA graphs; one that ran on a graph clears it."""

    expected: bool  # the profile leaves CUDA graphs on
    without: int = 0
    missing: bool = False
    seen: int = 0
    last_line: str = ""

    def feed(self, line: str) -> bool:
        got = decode_graph(line)
        if got is None:
            return False
        running, device, used = got
        if device != "cuda" or running > GRAPH_MAX_RUNNING:
            return False
        self.seen += 1
        before = self.missing
        if used:
            self.without = 0
            self.missing = False
        else:
            self.without += 1
            self.last_line = line.strip()[-300:]
            if self.expected and self.without >= GRAPH_COUNT:
                self.missing = True
        return self.missing != before


# Startup lines that show which path a launch runs on (shown beside the intent check).
STARTUP_EVIDENCE: tuple[tuple[str, re.Pattern[str]], ...] = (
    # arg_groups/overrides.py: each reason to turn the overlap scheduler off is a warning
    # naming the "overlap schedule" (0.5.23 says nothing when it stays on).
    ("overlap", re.compile(r"overlap schedul", re.IGNORECASE)),
    ("spec_v2", re.compile(r"\bspec(ulative)?[ _-]?v2\b", re.IGNORECASE)),
    # cuda_graph_setup.py:696: "Capture ... CUDA graph end. elapsed=..."
    ("graph_capture", re.compile(r"Capture [^\n]*graph end", re.IGNORECASE)),
)


def startup_evidence(line: str) -> tuple[str, str] | None:
    for key, pattern in STARTUP_EVIDENCE:
        m = pattern.search(line)
        if m is not None:
            return key, line.strip()[-300:]
    return None


def profile_disables_graphs(argv: Sequence[str]) -> bool:
    return "--disable-cuda-graph" in argv
