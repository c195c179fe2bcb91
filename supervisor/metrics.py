"""Prometheus metrics, all on a registry the daemon owns (tests build a fresh one).

Names follow the contract and Prometheus conventions: base units, `_total` counters, labels
`gpu` and `UUID` per GPU as NVIDIA's DCGM exporter names them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from supervisor import __version__
from supervisor.core.machine import ProbeKind, Reason, Regression, State
from supervisor.quality import DEGRADED_REASONS as QUALITY_REASONS
from supervisor.sglang.logscan import Stream
from supervisor.sglang.probe import FAILURE_REASONS

# Operations on the router's worker API (label `op` of kimi_serve_router_errors_total).
ROUTER_OPS = ("register", "deregister", "list", "drain")

# Decode probes: tens of ms on an idle H200 with EAGLE, up to the 30 s timeout under load.
# The admin endpoints that need the token, so their denied series exist from the first scrape
# (admin/app.py's route table is the authority; a test keeps the two in step).
ADMIN_PROTECTED_ENDPOINTS = (
    "/restart",
    "/drain",
    "/undrain",
    "/status",
    "/group",
    "/group/end",
    "/upgrade/accept",
    "/upgrade/rollback",
)
# The label of a refused request to a path no route has (supervisor/admin/app.py, _endpoint):
# created with the others, so it reads 0 from the first scrape.
ADMIN_OTHER_ENDPOINT = "other"

# From seconds (a crash on a warm, small model) to the ~10-minute cold load of a large one and
# the ~30-minute cold DeepGEMM compile (sglang#18823).
DOWNTIME_BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0)
PROBE_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)


class _GpuCollector(Collector):
    """Per-GPU memory and process counts, read at scrape time from the last snapshot."""

    def __init__(
        self,
        snapshot: Callable[[], Sequence[dict[str, Any]]],
        verdicts: Callable[[], Mapping[tuple[str, str], bool]] = dict,
    ) -> None:
        self._snapshot = snapshot
        self._verdicts = verdicts

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
        healthy = GaugeMetricFamily(
            "kimi_serve_gpu_healthy",
            "1 when the managed GPU is fit (not lost, no recovery action asked for, no pending "
            "or failed row remap, no volatile uncorrectable ECC error), 0 when it needs one.",
            labels=["gpu", "UUID"],
        )
        fit: dict[tuple[str, str], bool] = {}
        for g in self._snapshot():
            labels = [str(g["index"]), str(g["uuid"])]
            mem.add_metric(labels, float(g["memory_used_bytes"]))
            count = g["processes"]
            procs.add_metric(labels, float(len(count) if isinstance(count, list) else count))
            health = g.get("health")
            if isinstance(health, dict) and isinstance(health.get("ok"), bool):
                fit[(labels[0], labels[1])] = health["ok"]
        fit.update(self._verdicts())
        for (index, uuid), ok in sorted(fit.items()):
            healthy.add_metric([index, uuid], 1.0 if ok else 0.0)
        yield mem
        yield procs
        yield healthy


def _gauge(r: CollectorRegistry, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
    return Gauge(name, doc, labels, registry=r)


def _counter(r: CollectorRegistry, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    return Counter(name, doc, labels, registry=r)


def _histogram(
    r: CollectorRegistry, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]
) -> Histogram:
    return Histogram(name, doc, labels, buckets=buckets, registry=r)


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        gpu_snapshot: Callable[[], Sequence[dict[str, Any]]] = list,
    ) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.state = _gauge(
            r,
            "kimi_serve_state",
            "1 for the daemon's current state, 0 for the others.",
            ["state"],
        )
        self.ready = _gauge(
            r,
            "kimi_serve_ready",
            "1 when SGLang has passed a real decode probe and is serving (ready or degraded); "
            "on a multi-node follower, only while the leader reports the same launch ready.",
        )
        self.group_peer_up = _gauge(
            r,
            "kimi_serve_group_peer_up",
            "A multi-node replica: 1 when the peer's admin endpoint answered the last poll.",
            ["peer"],
        )
        self.restarts = _counter(
            r, "kimi_serve_restarts", "SGLang restarts, by reason.", ["reason"]
        )
        self.child_starts = _counter(r, "kimi_serve_child_starts", "SGLang processes launched.")
        self.handoffs = _counter(
            r,
            "kimi_serve_handoffs",
            "Hand-overs to a fresh exec of the daemon, by outcome: ok (SGLang adopted), "
            "fallback (relaunched), failed (no exec; the old daemon goes on).",
            ["outcome"],
        )
        for outcome in ("ok", "fallback", "failed"):  # series present from the first scrape
            self.handoffs.labels(outcome)
        self.trial = _gauge(
            r,
            "kimi_serve_trial",
            "1 while the launch is a trial: it differs from the last known good of its profile "
            "(SGLang, model files, argv, env) and has not yet served quality.trial_period.",
        )
        self.rollbacks = _counter(
            r,
            "kimi_serve_rollbacks",
            "Rollbacks to the last known good, by what the trial regressed on (canary, "
            "known_answers, speed, accept_length, crash_loop, manual).",
            ["regression"],
        )
        for regression in Regression:  # present from the first scrape: increase() sees a first
            self.rollbacks.labels(regression.value)
        self.lkg_serving = _gauge(
            r,
            "kimi_serve_lkg_serving",
            "1 while launches run the last known good's command instead of the config's "
            "(after a rollback, until a reload or kimi-serve upgrade accept).",
        )
        self.probe_duration = _histogram(
            r,
            "kimi_serve_probe_duration_seconds",
            "Decode probe round trip, by kind (readiness|liveness) and outcome.",
            ["kind", "outcome"],
            buckets=PROBE_BUCKETS,
        )
        self.probe_failures = _counter(
            r,
            "kimi_serve_probe_failures",
            "Failed decode probes, by kind and reason.",
            ["kind", "reason"],
        )
        self.last_load = _gauge(
            r,
            "kimi_serve_last_load_duration_seconds",
            "Seconds from launch to the first successful decode probe, for the last launch.",
        )
        self.restart_downtime = _histogram(
            r,
            "kimi_serve_restart_downtime_seconds",
            "From leaving ready to ready again, per restart nobody asked for (a crash loop's "
            "restarts before ready again are one).",
            (),
            buckets=DOWNTIME_BUCKETS,
        )
        self.child_start_time = _gauge(
            r,
            "kimi_serve_child_start_time_seconds",
            "Unix time the current SGLang process was started (0 when none runs).",
        )
        self.gpu_killed = _counter(
            r,
            "kimi_serve_gpu_leftover_processes_killed",
            "Leftover GPU processes killed before a launch, per GPU.",
            ["gpu", "UUID"],
        )
        self.gpu_release = _gauge(
            r,
            "kimi_serve_gpu_memory_release_seconds",
            "Seconds the last cleaning waited for GPU memory to be released.",
        )
        self.profile = _gauge(
            r,
            "kimi_serve_profile_info",
            "1 for the profile SGLang is launched with.",
            ["profile"],
        )
        self.build = _gauge(
            r,
            "kimi_serve_build_info",
            "kimi-serve's version and the SGLang version it runs.",
            ["version", "sglang_version"],
        )
        self.log_lines = _counter(
            r, "kimi_serve_log_lines", "Lines SGLang printed, by stream.", ["stream"]
        )
        self.log_suppressed = _counter(
            r,
            "kimi_serve_log_lines_suppressed",
            "SGLang lines not forwarded to the daemon's log under a flood (still scanned).",
        )
        self.mismatch = _gauge(
            r,
            "kimi_serve_server_arg_mismatch",
            "1 when the running server's resolved argument differs from the configured one.",
            ["arg"],
        )
        self.state_since = _gauge(
            r,
            "kimi_serve_state_since_seconds",
            "Unix time the current state was entered.",
        )
        self.router_registered = _gauge(
            r,
            "kimi_serve_router_registered",
            "1 while the router's worker list confirms this SGLang as registered.",
        )
        self.router_errors = _counter(
            r,
            "kimi_serve_router_errors",
            "Failed calls to the router's worker API, by operation.",
            ["op"],
        )
        for op in ROUTER_OPS:
            self.router_errors.labels(op)
        self.load_phase = _gauge(
            r,
            "kimi_serve_load_phase_seconds",
            "The last launch's load, split at SGLang's own log markers "
            "(supervisor/sglang/loadphases.py);"
            " a phase SGLang did not print is absent, not 0.",
            ["phase"],
        )
        self.admin_denied = _counter(
            r,
            "kimi_serve_admin_denied",
            "Admin requests refused for a missing or wrong bearer token, by endpoint.",
            ["endpoint"],
        )
        self._gpu_source = gpu_snapshot
        # kimi_serve_gpu_healthy: the fitness verdict of each managed GPU, read at scrape time
        # from the GPU snapshot (nvml.gpu_status()'s `health`); a verdict set here (the check
        # before a launch, a critical event) wins, so a GPU that is lost, and can no longer
        # be listed, still reads 0.
        self._gpu_fit: dict[tuple[str, str], bool] = {}
        self.gpu_xid_events = _counter(
            r,
            "kimi_serve_gpu_xid_events",
            "Critical Xid events NVML delivered for the managed GPU, by Xid.",
            ["gpu", "UUID", "xid"],
        )
        r.register(_GpuCollector(lambda: self._gpu_source(), lambda: self._gpu_fit))
        # Serving quality (docs/quality.md).
        self.canary_ok = _gauge(
            r,
            "kimi_serve_canary_ok",
            "1 when the last canary matched (or learned) the golden answer, 0 on a mismatch "
            "or while no canary has run on this launch.",
        )
        self.spec_accept_length = _gauge(
            r,
            "kimi_serve_spec_accept_length",
            "Mean speculative accept length (tokens per verification) of the launch; 0 without "
            "speculative decoding.",
        )
        self.decode_tps = _gauge(
            r,
            "kimi_serve_decode_tokens_per_second",
            "Single-stream decode speed of the last probe or canary, tokens/s.",
        )
        self.quality_degraded = _gauge(
            r,
            "kimi_serve_quality_degraded",
            "1 while the serving-quality reason holds (canary_mismatch, spec_collapse, "
            "slow_decode, no_cuda_graph).",
            ["reason"],
        )
        # Series that exist from the first scrape, so alerts and rate() see a zero, not a gap.
        for reason in Reason:
            self.restarts.labels(reason.value)
        for stream in Stream:
            self.log_lines.labels(stream.value)
        # Leftovers that held no GPU memory (a detokenizer) are counted here; the daemon
        # creates each managed GPU's series itself.
        self.gpu_killed.labels("none", "none")
        for kind in ProbeKind:
            for outcome in ("ok", "failed"):
                self.probe_duration.labels(kind.value, outcome)
            for failure in FAILURE_REASONS:
                self.probe_failures.labels(kind.value, failure)
        for endpoint in (*ADMIN_PROTECTED_ENDPOINTS, ADMIN_OTHER_ENDPOINT):
            self.admin_denied.labels(endpoint)
        for cause in QUALITY_REASONS:
            self.quality_degraded.labels(cause).set(0)
        self.set_state(State.STARTING, 0.0)
        self.build.labels(__version__, "unknown").set(1)

    def set_gpu_source(self, snapshot: Callable[[], Sequence[dict[str, Any]]]) -> None:
        """Where the per-GPU series are read from at scrape time."""
        self._gpu_source = snapshot

    def counters(self) -> list[list[Any]]:
        """Every counter's non-zero series as [name, labels, value], for a hand-over: the new
        program goes on from them (`continue_counters`). The hand-overs' own counter is carried
        apart (Handover.counted)."""
        out: list[list[Any]] = []
        for collector in self._counters():
            for family in collector.collect():
                for s in family.samples:
                    if s.name.endswith("_total") and s.value > 0:
                        out.append([family.name, dict(s.labels), float(s.value)])
        return out

    def continue_counters(self, carried: object) -> int:
        """Each carried counter series added to this program's (before /metrics is served,
        so no scrape sees one go back); what does not name a counter of ours with its labels,
        or is no finite non-negative number, is skipped. Returns how many were taken."""
        known = {c._name: c for c in self._counters()}
        taken = 0
        for item in carried if isinstance(carried, list) else []:
            if not (isinstance(item, list) and len(item) == 3):
                continue
            name, labels, value = item
            counter = known.get(name) if isinstance(name, str) else None
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if counter is None or not ok or not math.isfinite(value) or value <= 0:
                continue
            if not isinstance(labels, dict) or set(labels) != set(counter._labelnames):
                continue
            if not all(isinstance(v, str) for v in labels.values()):
                continue
            (counter.labels(**labels) if labels else counter).inc(value)
            taken += 1
        return taken

    def _counters(self) -> list[Counter]:
        return [c for c in vars(self).values() if isinstance(c, Counter) and c is not self.handoffs]

    def restart_counts(self) -> dict[str, int]:
        """Restarts by reason (those that happened), read from the counter itself."""
        out: dict[str, int] = {}
        for family in self.restarts.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.value:
                    out[sample.labels["reason"]] = int(sample.value)
        return out

    def set_gpu_healthy(self, index: int, uuid: str, healthy: bool) -> None:
        self._gpu_fit[(str(index), uuid)] = healthy

    def count_xid(self, index: int, uuid: str, xid: int) -> None:
        self.gpu_xid_events.labels(str(index), uuid, str(xid)).inc()

    def count_leftovers(self, killed: Iterable[tuple[str, str, int]]) -> None:
        """kimi_serve_gpu_leftover_processes_killed_total: (gpu, UUID, count) rows, as
        `gpu.leftover_rows()` gives them; gpu "none" for a leftover that held no GPU memory."""
        for index, uuid, count in killed:
            self.gpu_killed.labels(index, uuid).inc(count)

    def set_state(self, state: State, since_unix: float) -> None:
        for s in State:
            self.state.labels(s.value).set(1 if s is state else 0)
        self.ready.set(1 if state in (State.READY, State.DEGRADED) else 0)
        self.state_since.set(since_unix)

    def set_profile(self, profile: str, known: Iterable[str]) -> None:
        self.profile.clear()  # a profile removed by a reload must not stay at 1
        for name in known:
            self.profile.labels(name).set(1 if name == profile else 0)

    def set_load_phases(self, phases: dict[str, float]) -> None:
        # clear() first: a phase of the previous launch that this one did not print must go.
        self.load_phase.clear()
        for phase, seconds in phases.items():
            self.load_phase.labels(phase).set(seconds)

    def set_sglang_version(self, version: str) -> None:
        # SGLang's own word (/server_info): a label of at most 64 printable characters, so a
        # hostile server cannot make every scrape carry a megabyte.
        shown = "".join(c for c in version[:64] if c.isprintable()) or "unknown"
        self.build.clear()
        self.build.labels(__version__, shown).set(1)

    def set_router_registered(self, registered: bool) -> None:
        self.router_registered.set(1 if registered else 0)

    def router_error(self, op: str) -> None:
        self.router_errors.labels(op).inc()

    def set_quality(
        self, canary_ok: bool, accept: float | None, tps: float | None, degraded: Iterable[str]
    ) -> None:
        self.canary_ok.set(1 if canary_ok else 0)
        self.spec_accept_length.set(accept or 0.0)
        self.decode_tps.set(tps or 0.0)
        held = set(degraded)
        for reason in QUALITY_REASONS:
            self.quality_degraded.labels(reason).set(1 if reason in held else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
