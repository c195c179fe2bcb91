"""Where a load spends its time: SGLang's own log markers, split into phases.

A relaunch that takes 14 minutes instead of 10 is a black box unless someone can tell whether
the weights, the KV pool, CUDA graphs or the warm-up got slower. SGLang prints a line at each of
those milestones; this module turns them into durations. Pure: lines and times in, phases out.

The markers, as SGLang 0.5.23 prints them (file:line in docs/sglang.md, "Load markers"):

- `init`: from the launch (process start) to the first `Load weight begin`;
- `weights`: first `Load weight begin` to the last `Load weight end`;
- `kv_cache`: last `Load weight end` to the last `Memory pool end` (older releases print
  `KV Cache is allocated`);
- `cuda_graph`: first `Capture ... graph begin` to the last `Capture ... graph end`;
- `warmup`: the HTTP port open (or `Uvicorn running on`) to `The server is fired up and ready
  to roll!` (SGLang's own warm-up request runs in between);
- `probe`: that line (or the port, if the probe passed first) to kimi-serve's first
  successful decode probe.

Every tensor-parallel rank prints its own markers, so a phase runs from the first rank's start to
the last rank's end. A phase whose markers a release does not print (no CUDA graphs with
`--disable-cuda-graph`, a release that renamed a line) is *absent*, never 0: a 0 would read as
"that took no time".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

PHASES = ("init", "weights", "kv_cache", "cuda_graph", "warmup", "probe")

_WEIGHTS_BEGIN = "Load weight begin"
_WEIGHTS_END = "Load weight end"
_GRAPH = re.compile(r"Capture .*?graph (begin|end)\b", re.IGNORECASE)
_UVICORN = "Uvicorn running on"
_READY = "The server is fired up and ready to roll!"
_REPORTED = re.compile(r"(\w+)=(\d+(?:\.\d+)?)")


@dataclass
class LoadTimeline:
    """One launch's load. Feed it every SGLang line with the (monotonic) time it was read."""

    launched_at: float
    marks: dict[str, float] = field(default_factory=dict)
    reported: dict[str, float] = field(default_factory=dict)

    def _first(self, name: str, t: float) -> None:
        self.marks.setdefault(name, t)

    def _last(self, name: str, t: float) -> None:
        self.marks[name] = t

    def feed(self, line: str, t: float) -> None:
        if "ready" in self.marks or "probe_ok" in self.marks:
            # The load is over; later lines (requests, a re-capture) are not load. The decode
            # probe can pass before SGLang's own warm-up says so (seen with 0.5.23 on a CPU:
            # 58 s before): then that warm-up did not delay serving, and stays absent.
            return
        if "Engine startup timings" in line:
            # SGLang's own summary (entrypoints/engine.py:1118), kept beside ours.
            self.reported = {k: float(v) for k, v in _REPORTED.findall(line)}
            return
        if _WEIGHTS_BEGIN in line:
            self._first("weights_begin", t)
        elif _WEIGHTS_END in line:
            self._last("weights_end", t)
        # Plain substring tests before any regex: every SGLang line passes here during a load
        # (100k lines/s in a flood), and SGLang's decode lines say "cuda graph: True".
        elif "Memory pool end" in line or "KV Cache is allocated" in line:
            self._last("kv_end", t)
            if "weights_end" in self.marks:
                self._first("kv_begin", self.marks["weights_end"])
        elif "apture" in line and (m := _GRAPH.search(line)):
            if m.group(1).lower() == "begin":
                self._first("graph_begin", t)
            else:
                self._last("graph_end", t)
        elif _UVICORN in line:
            self._first("port_open", t)
        elif _READY in line:
            self._first("ready", t)

    def port_open(self, t: float) -> None:
        """SGLang bound its HTTP port: its warm-up request follows (http_server.py)."""
        self._first("port_open", t)

    def probe_ok(self, t: float) -> None:
        """kimi-serve's first successful readiness probe: the load is complete."""
        self._first("probe_ok", t)

    def phases(self) -> dict[str, float]:
        """Seconds per phase, in load order; only phases whose both ends were seen."""
        m = self.marks
        spans = {
            "init": (self.launched_at, m.get("weights_begin")),
            "weights": (m.get("weights_begin"), m.get("weights_end")),
            "kv_cache": (m.get("kv_begin"), m.get("kv_end")),
            "cuda_graph": (m.get("graph_begin"), m.get("graph_end")),
            "warmup": (m.get("port_open"), m.get("ready")),
            # From SGLang's "ready", or from the port when the probe passed before that line.
            "probe": (m.get("ready", m.get("port_open")), m.get("probe_ok")),
        }
        out: dict[str, float] = {}
        for name in PHASES:
            start, end = spans[name]
            if start is not None and end is not None and end >= start:
                out[name] = round(end - start, 3)
        return out

    def document(self) -> dict[str, Any]:
        """`/status.last_load`."""
        done = self.marks.get("probe_ok")
        return {
            "complete": done is not None,
            "total_s": round(done - self.launched_at, 3) if done is not None else None,
            "phases": self.phases(),
            "missing": [p for p in PHASES if p not in self.phases()],
            "sglang_reported": self.reported,
        }
