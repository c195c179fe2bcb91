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
- `warmup`: the HTTP port open (or `Uvicorn running on`) to the earlier of `The server is fired
  up and ready to roll!` and the start of kimi-serve's first successful decode probe. SGLang's
  own warm-up (`_wait_and_warmup`: a 1 s sleep, `/model_info`, an 8-token `/generate`) runs in
  this span; whichever of the two comes first says the server took requests, so a healthy load
  always has this phase, even when our probe passes before SGLang's line (0.5.23 on a CPU);
- `probe`: the end of `warmup` to that probe's success: the probe's own span when it started
  before SGLang's line, else SGLang's line to the probe passing (our readiness lag).

`warmup` and `probe` are contiguous: together they are the time from the port opening to
decode-verified ready.

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
_GRAPH_GROUP = re.compile(r"cuda_graph=\{([^}]*)\}")


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
            # 58 s before): then warmup already ended at the probe's start.
            return
        if "Engine startup timings" in line:
            # SGLang's own summary (entrypoints/engine.py:1118), kept beside ours.
            # `cuda_graph={phase=..., ...}`: keyed `cuda_graph.<phase>`, as from /server_info.
            graph = _GRAPH_GROUP.search(line)
            inner = graph.group(1) if graph else ""
            rest = line.replace(graph.group(0), "") if graph else line
            self.reported = {k: float(v) for k, v in _REPORTED.findall(rest)}
            self.reported.update({f"cuda_graph.{k}": float(v) for k, v in _REPORTED.findall(inner)})
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

    def server_info(self, doc: dict[str, Any]) -> bool:
        """`/server_info`'s `startup_time` (http_server.py:886 in 0.5.23: the same numbers as
        the log line, `cuda_graph` a mapping): kept where the log line gave none. True when
        it added something."""
        st = doc.get("startup_time")
        if not isinstance(st, dict) or self.reported:
            return False
        out: dict[str, float] = {}
        for key, value in st.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        out[f"{key}.{sub}"] = float(v)
            elif isinstance(value, int | float) and not isinstance(value, bool):
                out[str(key)] = float(value)
        self.reported = out
        return bool(out)

    def port_open(self, t: float) -> None:
        """SGLang bound its HTTP port: its warm-up request follows (http_server.py)."""
        self._first("port_open", t)

    def probe_ok(self, t: float, latency_s: float | None = None) -> None:
        """kimi-serve's first successful readiness probe, answered at `t` after `latency_s`
        (its request's own span, `ProbeResult.latency_s`): the load is complete."""
        if "probe_ok" in self.marks:
            return
        self.marks["probe_ok"] = t
        if latency_s is not None:
            self.marks["probe_start"] = t - max(0.0, latency_s)

    def phases(self) -> dict[str, float]:
        """Seconds per phase, in load order; only phases whose both ends were seen."""
        m = self.marks
        spans = {
            "init": (self.launched_at, m.get("weights_begin")),
            "weights": (m.get("weights_begin"), m.get("weights_end")),
            "kv_cache": (m.get("kv_begin"), m.get("kv_end")),
            "cuda_graph": (m.get("graph_begin"), m.get("graph_end")),
            "warmup": (m.get("port_open"), self._warmup_end()),
            "probe": (self._probe_start(), m.get("probe_ok")),
        }
        out: dict[str, float] = {}
        for name in PHASES:
            start, end = spans[name]
            if start is not None and end is not None and end >= start:
                out[name] = round(end - start, 3)
        return out

    def current(self) -> str:
        """The phase the load is in: the last one whose start was seen (`done` once the probe
        passed). Between two phases (a graph captured, the port not yet open) it is the one
        that ended last, so the name never runs ahead of what SGLang printed."""
        m = self.marks
        for name, mark in (
            ("done", "probe_ok"),
            ("probe", "ready"),
            ("warmup", "port_open"),
            ("cuda_graph", "graph_begin"),
            ("kv_cache", "weights_end"),
            ("weights", "weights_begin"),
        ):
            if mark in m:
                return name
        return "init"

    def _warmup_end(self) -> float | None:
        """The earlier of SGLang's ready line and the start of the probe that passed: from
        then on the server was taking requests. Never before the port opened (a probe is
        started by the port opening; clocks read in different places may disagree by ms)."""
        ends = [self.marks[k] for k in ("ready", "probe_start") if k in self.marks]
        if not ends:
            return None
        end = min(ends)
        port = self.marks.get("port_open")
        return end if port is None else max(end, port)

    def _probe_start(self) -> float | None:
        end = self._warmup_end()
        return end if end is not None else self.marks.get("port_open")

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
