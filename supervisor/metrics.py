"""Prometheus metrics, all on a registry the daemon owns (tests build a fresh one).

Names follow the contract and Prometheus conventions: base units, `_total` counters, labels
`gpu` and `UUID` per GPU as NVIDIA's DCGM exporter names them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from supervisor import __version__
from supervisor.logscan import Stream
from supervisor.machine import ProbeKind, Reason, State
from supervisor.probe import FAILURE_REASONS

# Operations on the router's worker API (label `op` of kimi_serve_router_errors_total).
ROUTER_OPS = ("register", "deregister", "list", "drain")

# Decode probes: tens of ms on an idle H200 with EAGLE, up to the 30 s timeout under load.
PROBE_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)


class _GpuCollector(Collector):
    """Per-GPU memory and process counts, read at scrape time from the last snapshot."""

    def __init__(self, snapshot: Callable[[], Sequence[dict[str, Any]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[GaugeMetricFamily]:
        mem = GaugeMetricFamily(
            "kimi_serve_gpu_memory_used_bytes",
            "GPU memory in use at the last check, per managed GPU.",
            labels=["gpu", "UUID"],
        )
        procs = GaugeMetricFamily(
            "kimi_serve_gpu_processes",
            "Compute processes on the GPU at the last check.",
            labels=["gpu", "UUID"],
        )
        for g in self._snapshot():
            labels = [str(g["index"]), str(g["uuid"])]
            mem.add_metric(labels, float(g["memory_used_bytes"]))
            count = g["processes"]
            procs.add_metric(labels, float(len(count) if isinstance(count, list) else count))
        yield mem
        yield procs


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        gpu_snapshot: Callable[[], Sequence[dict[str, Any]]] = list,
    ) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.state = Gauge(
            "kimi_serve_state",
            "1 for the daemon's current state, 0 for the others.",
            ["state"],
            registry=r,
        )
        self.ready = Gauge(
            "kimi_serve_ready",
            "1 when SGLang has passed a real decode probe and is serving (ready or degraded).",
            registry=r,
        )
        self.restarts = Counter(
            "kimi_serve_restarts", "SGLang restarts, by reason.", ["reason"], registry=r
        )
        self.child_starts = Counter(
            "kimi_serve_child_starts", "SGLang processes launched.", registry=r
        )
        self.probe_duration = Histogram(
            "kimi_serve_probe_duration_seconds",
            "Decode probe round trip, by kind (readiness|liveness) and outcome.",
            ["kind", "outcome"],
            buckets=PROBE_BUCKETS,
            registry=r,
        )
        self.probe_failures = Counter(
            "kimi_serve_probe_failures",
            "Failed decode probes, by kind and reason.",
            ["kind", "reason"],
            registry=r,
        )
        self.last_load = Gauge(
            "kimi_serve_last_load_duration_seconds",
            "Seconds from launch to the first successful decode probe, for the last launch.",
            registry=r,
        )
        self.child_start_time = Gauge(
            "kimi_serve_child_start_time_seconds",
            "Unix time the current SGLang process was started (0 when none runs).",
            registry=r,
        )
        self.gpu_killed = Counter(
            "kimi_serve_gpu_leftover_processes_killed",
            "Leftover GPU processes killed before a launch, per GPU.",
            ["gpu", "UUID"],
            registry=r,
        )
        self.gpu_release = Gauge(
            "kimi_serve_gpu_memory_release_seconds",
            "Seconds the last cleaning waited for GPU memory to be released.",
            registry=r,
        )
        self.profile = Gauge(
            "kimi_serve_profile_info",
            "1 for the profile SGLang is launched with.",
            ["profile"],
            registry=r,
        )
        self.build = Gauge(
            "kimi_serve_build_info",
            "kimi-serve's version and the SGLang version it runs.",
            ["version", "sglang_version"],
            registry=r,
        )
        self.log_lines = Counter(
            "kimi_serve_log_lines", "Lines SGLang printed, by stream.", ["stream"], registry=r
        )
        self.log_suppressed = Counter(
            "kimi_serve_log_lines_suppressed",
            "SGLang lines not forwarded to the daemon's log under a flood (still scanned).",
            registry=r,
        )
        self.mismatch = Gauge(
            "kimi_serve_server_arg_mismatch",
            "1 when the running server's resolved argument differs from the configured one.",
            ["arg"],
            registry=r,
        )
        self.state_since = Gauge(
            "kimi_serve_state_since_seconds",
            "Unix time the current state was entered.",
            registry=r,
        )
        self.router_registered = Gauge(
            "kimi_serve_router_registered",
            "1 while the router's worker list confirms this SGLang as registered.",
            registry=r,
        )
        self.router_errors = Counter(
            "kimi_serve_router_errors",
            "Failed calls to the router's worker API, by operation.",
            ["op"],
            registry=r,
        )
        for op in ROUTER_OPS:
            self.router_errors.labels(op)
        r.register(_GpuCollector(gpu_snapshot))
        # Series that exist from the first scrape, so alerts and rate() see a zero, not a gap.
        for reason in Reason:
            self.restarts.labels(reason.value)
        for stream in Stream:
            self.log_lines.labels(stream.value)
        for kind in ProbeKind:
            for outcome in ("ok", "failed"):
                self.probe_duration.labels(kind.value, outcome)
            for failure in FAILURE_REASONS:
                self.probe_failures.labels(kind.value, failure)
        self.set_state(State.STARTING, 0.0)
        self.build.labels(__version__, "unknown").set(1)

    def set_state(self, state: State, since_unix: float) -> None:
        for s in State:
            self.state.labels(s.value).set(1 if s is state else 0)
        self.ready.set(1 if state in (State.READY, State.DEGRADED) else 0)
        self.state_since.set(since_unix)

    def set_profile(self, profile: str, known: Iterable[str]) -> None:
        self.profile.clear()  # a profile removed by a reload must not stay at 1
        for name in known:
            self.profile.labels(name).set(1 if name == profile else 0)

    def set_sglang_version(self, version: str) -> None:
        self.build.clear()
        self.build.labels(__version__, version).set(1)

    def set_router_registered(self, registered: bool) -> None:
        self.router_registered.set(1 if registered else 0)

    def router_error(self, op: str) -> None:
        self.router_errors.labels(op).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
