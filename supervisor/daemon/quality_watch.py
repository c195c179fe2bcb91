"""Serving quality, the effects: the canary request and its golden answer, speed and accept
length read from every probe and SGLang's gauge, the decode path read from SGLang's lines.

The verdicts are supervisor.quality's (pure); the machine decides what a mismatch before ready and a
speculation collapse with `on_spec_collapse: fallback` mean (machine.Machine._probe_done,
_spec_collapsed). Everything else is reported only: /status.quality, the kimi_serve_canary_ok,
kimi_serve_spec_accept_length, kimi_serve_decode_tokens_per_second and
kimi_serve_quality_degraded{reason} series, and one log event per change (docs/quality.md).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import httpx

from supervisor import log, threads
from supervisor.config import Config
from supervisor.core.machine import ProbeDone, SpecCollapsed
from supervisor.metrics import Metrics
from supervisor.quality import (
    CANARY_MISMATCH,
    DEGRADED_REASONS,
    DISABLED,
    LEARNED,
    MATCHED,
    MISMATCH,
    NO_CUDA_GRAPH,
    SLOW_DECODE,
    SPEC_COLLAPSE,
    SPEC_GAUGE,
    UNKNOWN,
    Answer,
    GraphWatch,
    KnownResult,
    SpecWatch,
    SpeedWatch,
    accept_length,
    compare,
    decode_speed,
    known_tokens,
    profile_disables_graphs,
    startup_evidence,
)
from supervisor.quality.asking import ask
from supervisor.quality.golden import (
    CanaryStore,
    Golden,
    default_dir,
    golden_key,
    layout,
    model_identity,
)
from supervisor.sglang import endpoints
from supervisor.sglang.argv import LaunchSpec
from supervisor.sglang.probe import (
    ProbeGate,
    progress_of,
    server_url,
)

CANARY_TIMEOUT_S = 30.0
# Decode tokens the counter may add beyond the probe's own (SGLang's warmup, rounding).
OTHERS_SLACK_TOKENS = 2
INFO_TIMEOUT_S = 10.0
# The golden store's reads and writes (a few KiB) and the model's content identity (a few MiB
# per TB): a hung mount abandons the call at its deadline (threads.in_thread), and the canary
# has no evidence (canary_unavailable under the gate).
STORE_TIMEOUT_S = 10.0
IDENTITY_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class CanaryOutcome:
    """What the canary tells the machine (ProbeDone): a wrong answer (`mismatch`: expected,
    got), or no evidence at all (`unavailable`: why). Neither: the answer is right."""

    mismatch: str | None = None
    unavailable: str | None = None
    known_failed: bool = False  # the mismatch is a known answer's (quality.known_answers)


async def sglang_version(http: httpx.AsyncClient, base: str) -> str:
    info = await endpoints.server_info(http, base, INFO_TIMEOUT_S)
    version = None if info is None else info.get("version")
    return version if isinstance(version, str) else "unknown"


@dataclasses.dataclass
class _LaunchQuality:
    launch: int
    speculative: bool
    speed: SpeedWatch
    spec: SpecWatch
    graph: GraphWatch
    layout: str = ""
    key: str | None = None
    identity: str | None = None
    version: str | None = None
    canary: dict[str, Any] = dataclasses.field(default_factory=dict)
    evidence: dict[str, str] = dataclasses.field(default_factory=dict)
    first_canary_ms: float | None = None
    probes: int = 0  # successful probes whose speed and accept length were read
    # The canary's speed (tokens/s, SGLang-measured), judged with its probe's (probe_done):
    # only there is it known whether others decoded meanwhile.
    canary_speed: tuple[float | None, bool] | None = None


def changed(prev: Golden, new: Golden) -> str:
    """What differs between the key of `prev` and that of `new`, in words."""
    parts = []
    if prev.sglang_version != new.sglang_version:
        parts.append(f"SGLang {prev.sglang_version} -> {new.sglang_version}")
    if prev.identity != new.identity:
        parts.append(f"model files {prev.identity[:12]} -> {new.identity[:12]} ({new.model_path})")
    if prev.layout != new.layout:
        parts.append(f"layout {prev.layout or '(none)'} -> {new.layout or '(none)'}")
    what = ", ".join(parts) or "the golden key"
    return f"{what} changed, and the answer disagrees with the golden of {prev.key}"


class QualityWatch:
    def __init__(
        self,
        cfg: Config,
        http: httpx.AsyncClient,
        metrics: Metrics,
        emit: Callable[[Any], None],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.http = http
        self.metrics = metrics
        self.emit = emit
        self.wall = wall
        self.log = log.get()
        self.store = CanaryStore(default_dir(cfg.state_dir))
        self.cur: _LaunchQuality | None = None
        self._identities: dict[str, str] = {}
        self.canaries = 0  # canaries run by this daemon (tests, bench)
        self.mismatches = 0

    def reconfigure(self, cfg: Config) -> None:
        self.cfg = cfg

    # ------------------------------------------------------------------ per launch

    def launched(self, launch: int, spec: LaunchSpec) -> None:
        self.cur = _LaunchQuality(
            launch=launch,
            speculative=spec.speculative,
            layout=layout(spec.args),
            speed=SpeedWatch(),
            spec=SpecWatch(self.cfg.quality.spec_accept_floor),
            graph=GraphWatch(expected=not profile_disables_graphs(spec.argv)),
            canary={"state": UNKNOWN if self.cfg.quality.canary.enabled else DISABLED},
        )
        self._publish()

    def line(self, text: str) -> None:
        cur = self.cur
        if cur is None:
            return
        # Substring checks first: every line of a log flood passes here.
        if "Decode batch" in text:
            if cur.graph.feed(text):
                self._changed(NO_CUDA_GRAPH, cur.graph.missing, cur.graph.last_line)
            return
        if "verlap" not in text and "v2" not in text and "raph end" not in text:
            return
        ev = startup_evidence(text)
        if ev is not None and ev[0] not in cur.evidence:
            cur.evidence[ev[0]] = ev[1]

    # ------------------------------------------------------------------ the canary

    async def _key(self, cur: _LaunchQuality, base: str) -> str:
        if cur.key is None:
            path = self.cfg.sglang.model_path
            if path not in self._identities:
                # A few MiB read per TB of weights (canary_store): off the loop all the same.
                self._identities[path] = await threads.in_thread(
                    lambda: model_identity(path), IDENTITY_TIMEOUT_S
                )
            cur.identity = self._identities[path]
            cur.version = await sglang_version(self.http, base)
            ccfg = self.cfg.quality.canary
            cur.key = golden_key(
                cur.identity, cur.version, ccfg.prompt, ccfg.max_tokens, cur.layout
            )
        return cur.key

    async def canary(self, launch: int, gate: ProbeGate) -> CanaryOutcome:
        """Run the canary against the golden of this key. No golden yet (a new key: another
        SGLang version, other model files): the answer is verified first, against the known
        answers and the previous key's golden, and only then learned."""
        cur, ccfg = self.cur, self.cfg.quality.canary
        if cur is None or cur.launch != launch or not ccfg.enabled:
            return CanaryOutcome()
        base = server_url(self.cfg.sglang.host, self.cfg.sglang.port)
        timeout = min(CANARY_TIMEOUT_S, max(self.cfg.readiness.probe.timeout, 1.0))
        try:
            key = await self._key(cur, base)
        except (TimeoutError, OSError) as exc:
            return self._unknown(cur, f"model identity unreadable: {exc or 'timed out'}")
        got, took = await gate.exclusive(
            lambda: ask(self.http, base, ccfg.prompt, ccfg.max_tokens, timeout)
        )
        self.canaries += 1
        if cur.first_canary_ms is None:
            cur.first_canary_ms = took * 1000
        if isinstance(got, str):
            return self._unknown(cur, got)
        try:
            golden = await self._store(lambda: self.store.golden(key))
        except (TimeoutError, OSError) as exc:
            return self._unknown(cur, f"golden unreadable: {exc or 'timed out'}")
        at = self.wall()
        record = Golden(
            key=key,
            answer=got,
            model_path=self.cfg.sglang.model_path,
            identity=cur.identity or "",
            sglang_version=cur.version or "unknown",
            prompt=ccfg.prompt,
            max_tokens=ccfg.max_tokens,
            learned_at=at,
            how="received",
            generation=time.time_ns(),
            layout=cur.layout,
        )
        state, detail = MATCHED, ""
        if golden is None:
            verified = await self._verify(cur, base, gate, record, timeout)
            if isinstance(verified, CanaryOutcome):
                return verified
            record, failure = verified
            if failure is not None:
                await self._save_last(record)
                out = self._mismatch(cur, record, key, failure, took)
                known_failed = any(not k.ok for k in record.known)
                return dataclasses.replace(out, known_failed=known_failed)
            golden = dataclasses.replace(record, how="learned")
            try:
                await self._store(lambda: self.store.save_golden(golden))
            except (TimeoutError, OSError) as exc:
                self.log.error("canary store unwritable", dir=str(self.store.dir), error=str(exc))
                return self._unknown(cur, f"golden not learned: {exc or 'timed out'}")
            state, detail = LEARNED, "golden answer learned"
            self.log.info(
                "canary golden learned",
                key=key,
                verified_against=golden.verified_against,
                known_answers=len(golden.known),
            )
        if golden.answer.server_measured:
            cur.speed.golden_tps = golden.answer.tokens_per_second
        cur.canary_speed = (got.tokens_per_second, got.server_measured)
        verdict = compare(golden.answer, got)
        base_doc = self._doc(golden, got, verdict.checked, took, at)
        if verdict.weak:
            base_doc["weak"] = True
        if state == MATCHED and not verdict.match:
            # The known answers' results go with the received answer, for `canary accept`
            # to show (and to refuse it if they fail); without an answer, none are recorded.
            known = await self._ask_known(cur, base, gate, timeout)
            if not isinstance(known, CanaryOutcome):
                record = dataclasses.replace(record, known=tuple(known))
            await self._save_last(record)
            detail = verdict.detail(golden.answer, got)
            return self._mismatch(cur, golden, key, detail, took, got, verdict.checked)
        await self._save_last(record)
        cur.canary = {"state": state, **base_doc}
        self._changed(CANARY_MISMATCH, False, detail)
        return CanaryOutcome()

    async def _verify(
        self, cur: _LaunchQuality, base: str, gate: ProbeGate, record: Golden, timeout: float
    ) -> tuple[Golden, str | None] | CanaryOutcome:
        """A new key's answer before it is learned: (the record with what it was checked
        against, why it is wrong or None), or no evidence (a known answer got no answer)."""
        known = await self._ask_known(cur, base, gate, timeout)
        if isinstance(known, CanaryOutcome):
            return known
        record = dataclasses.replace(record, known=tuple(known))
        failed = [k for k in known if not k.ok]
        if failed:
            return record, failed[0].detail()
        try:
            prev = await self._store(
                lambda: self.store.previous(record.prompt, record.max_tokens, record.key)
            )
        except (TimeoutError, OSError):
            prev = None
        if prev is None:
            return record, None
        record = dataclasses.replace(record, verified_against=prev.key)
        verdict = compare(prev.answer, record.answer)
        if verdict.match:
            return record, None
        return record, f"{changed(prev, record)}: {verdict.detail(prev.answer, record.answer)}"

    async def _ask_known(
        self, cur: _LaunchQuality, base: str, gate: ProbeGate, timeout: float
    ) -> list[KnownResult] | CanaryOutcome:
        """quality.known_answers asked of the launch, or no evidence (one got no answer)."""
        known: list[KnownResult] = []
        for prompt, expect in self.cfg.quality.known_answers:
            n = known_tokens(expect)
            got, _ = await gate.exclusive(
                functools.partial(ask, self.http, base, prompt, n, timeout)
            )
            if isinstance(got, str):
                return self._unknown(cur, f"known answer to {prompt!r}: {got}")
            known.append(KnownResult(prompt, expect, got.text))
        return known

    def _doc(
        self, golden: Golden, got: Answer, checked: int, took: float, at: float
    ) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "at": at,
            "expected": golden.answer.text,
            "got": got.text,
            "checked_tokens": checked,
            "golden": golden.how,
            "ms": round(took * 1000, 1),
        }
        if golden.verified_against:
            doc["verified_against"] = golden.verified_against
        if golden.known:
            doc["known_answers"] = [k.to_json() for k in golden.known]
        return doc

    def _mismatch(
        self,
        cur: _LaunchQuality,
        golden: Golden,
        key: str,
        detail: str,
        took: float,
        got: Answer | None = None,
        checked: int = 0,
    ) -> CanaryOutcome:
        self.mismatches += 1
        answer = golden.answer if got is None else got
        doc = self._doc(golden, answer, checked, took, self.wall())
        if got is None:
            doc["expected"] = None  # nothing learned: a new key failed its verification
        cur.canary = {"state": MISMATCH, **doc, "detail": detail}
        self.log.error("canary mismatch", detail=detail, key=key)
        self._changed(CANARY_MISMATCH, True, detail)
        return CanaryOutcome(mismatch=detail)

    def _unknown(self, cur: _LaunchQuality, error: str) -> CanaryOutcome:
        cur.canary = {**cur.canary, "state": UNKNOWN, "at": self.wall(), "error": error}
        self.log.warning("canary", outcome="unknown", error=error)
        self._publish()
        return CanaryOutcome(unavailable=error)

    async def _store(self, fn: Callable[[], Any]) -> Any:
        return await threads.in_thread(fn, STORE_TIMEOUT_S)

    async def _save_last(self, record: Golden) -> None:
        """The last answer received, for `canary accept`; a failure is logged, never fatal."""
        try:
            await self._store(lambda: self.store.save_last(record))
        except (TimeoutError, OSError) as exc:
            self.log.error("canary store unwritable", dir=str(self.store.dir), error=str(exc))

    # ------------------------------------------------------------------ probes and gauges

    def gate_readings(self, done: ProbeDone) -> tuple[float | None, float | None]:
        """The launch's single-stream decode tokens/s and accept length at its gate (the
        readiness probe and the canary that rode it, idle, on the fixed prompts): the best
        speed of the two, the probe's accept length. What a trial is judged on against the
        last known good (core/upgrade_rules.py); (None, None) on a busy gate."""
        cur = self.cur
        if cur is None or cur.launch != done.launch or not done.result.ok or done.busy:
            return None, None
        speeds = [decode_speed(done.result.meta, done.result.latency_s)]
        if cur.canary_speed is not None:
            speeds.append(cur.canary_speed[0])
        measured = [s for s in speeds if s is not None and s > 0]
        tps = max(measured) if measured else None
        accept = accept_length(done.result.meta) if cur.speculative else None
        return tps, accept

    async def probe_done(
        self, done: ProbeDone, decoded_before: float | None = None, own_tokens: int = 0
    ) -> None:
        """Speed and accept length from a probe's answer, the gauge from SGLang's /metrics.

        The speed sample is skipped when others decoded meanwhile: SGLang's decode counter
        (`sglang:realtime_tokens_total{mode="decode"}`) moved by more than the probe's and the
        canary's own tokens (`own_tokens`), or requests still run right after it. The canary
        that rode the probe is judged the same way: a canary served beside other requests is
        slower by design, never a sign of slow decoding."""
        cur = self.cur
        if cur is None or cur.launch != done.launch or not done.result.ok:
            return
        canary_speed, cur.canary_speed = cur.canary_speed, None
        meta = done.result.meta
        cur.probes += 1
        base = server_url(self.cfg.sglang.host, self.cfg.sglang.port)
        samples = await endpoints.fetch_samples(self.http, base)  # one parse for all three
        progress = None if samples is None else progress_of(samples)
        running = None if samples is None else endpoints.mean(samples, "sglang:num_running_reqs")
        decoded_after = None if progress is None else progress.realtime_decode
        others = (
            decoded_before is not None
            and decoded_after is not None
            and decoded_after - decoded_before > own_tokens + OTHERS_SLACK_TOKENS
        )
        busy = done.busy or others or bool(running and running > 0)
        speeds = [(decode_speed(meta, done.result.latency_s), "decode_throughput" in meta)]
        if canary_speed is not None:
            speeds.append(canary_speed)
        for tps, measured in speeds:
            if cur.speed.add(tps, busy, server_measured=measured):
                self._slow_changed(cur)
        if cur.speculative:
            gauge = None if samples is None else endpoints.mean(samples, SPEC_GAUGE)
            if cur.spec.add(accept_length(meta), gauge):
                self._changed(SPEC_COLLAPSE, cur.spec.collapsed, cur.spec.detail())
                if cur.spec.collapsed:
                    self.emit(SpecCollapsed(cur.launch, cur.spec.detail()))
        self._publish()

    def _slow_changed(self, cur: _LaunchQuality) -> None:
        self._changed(SLOW_DECODE, cur.speed.slow, cur.speed.detail())

    # ------------------------------------------------------------------ reporting

    def degraded(self) -> list[str]:
        cur = self.cur
        if cur is None:
            return []
        held = {
            CANARY_MISMATCH: cur.canary.get("state") == MISMATCH,
            SPEC_COLLAPSE: cur.spec.collapsed,
            SLOW_DECODE: cur.speed.slow,
            NO_CUDA_GRAPH: cur.graph.missing,
        }
        return [r for r in DEGRADED_REASONS if held[r]]

    def _changed(self, reason: str, on: bool, detail: str) -> None:
        if on:
            self.log.warning("quality degraded", reason=reason, detail=detail)
        self._publish()

    def _publish(self) -> None:
        cur = self.cur
        state = None if cur is None else cur.canary.get("state")
        self.metrics.set_quality(
            canary_ok=state in (LEARNED, MATCHED),
            accept=None if cur is None else cur.spec.value,
            tps=None if cur is None else cur.speed.last,
            degraded=self.degraded(),
        )

    def status(self) -> dict[str, Any]:
        cur = self.cur
        if cur is None:
            state = UNKNOWN if self.cfg.quality.canary.enabled else DISABLED
            return {
                "canary": {"state": state, "at": None, "expected": None, "got": None},
                "spec_accept_length": None,
                "decode_tokens_per_second": None,
                "degraded": [],
            }
        canary = {
            "at": None,
            "expected": None,
            "got": None,
            **cur.canary,
            "runs": self.canaries,
            "mismatches": self.mismatches,
        }
        return {
            "canary": canary,
            "spec_accept_length": cur.spec.value if cur.speculative else None,
            "decode_tokens_per_second": cur.speed.last,
            "decode_reference": cur.speed.reference,
            "degraded": self.degraded(),
            "probes_judged": cur.probes,
            "evidence": {
                **cur.evidence,
                "decode_batches_judged": cur.graph.seen,
                "graphs_expected": cur.graph.expected,
            },
            "golden_key": cur.key,
        }
