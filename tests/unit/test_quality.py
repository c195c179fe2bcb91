"""Serving quality's pure verdicts (supervisor/quality/__init__.py), the golden store's content
identity (supervisor/quality/golden.py), and what the machine does with a canary mismatch and a
speculation collapse."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import quality as q
from supervisor.core.machine import (
    ChildGone,
    HostReady,
    Launched,
    PortOpen,
    ProbeDone,
    ProbeKind,
    ProfileChanged,
    Reason,
    RecordRestart,
    SpecCollapsed,
    StartProbe,
    State,
    StopChild,
    TimerFired,
    TimerName,
)
from supervisor.daemon.quality_watch import CanaryOutcome, QualityWatch
from supervisor.metrics import Metrics
from supervisor.quality import Answer
from supervisor.quality.golden import CanaryStore, Golden, golden_key, model_identity
from supervisor.sglang.argv import LaunchSpec
from supervisor.sglang.probe import ProbeGate, Progress
from testkit.machine import CFG, FALLBACK, Drive, make_cfg, ok_result, with_canary


def answer(tokens: list[int], margins: list[float | None], top2: list[int] | None = None) -> Answer:
    return Answer(
        text=" ".join(map(str, tokens)),
        tokens=tuple(tokens),
        margins=tuple(margins),
        top2=tuple(top2 or [t + 1000 for t in tokens]),
    )


# ------------------------------------------------------------------------------ comparison


def test_identical_answer_matches() -> None:
    g = answer([1, 2, 3, 4], [5.0, 5.0, 5.0, 5.0])
    c = q.compare(g, g)
    assert c.match and c.checked == 4 and not c.weak


def test_a_confident_token_that_differs_is_a_mismatch() -> None:
    g = answer([1, 2, 3, 4], [5.0, 5.0, 5.0, 5.0])
    c = q.compare(g, answer([1, 2, 9, 4], [5.0] * 4))
    assert not c.match and c.first_diff == 2
    assert "expected '1 2 3 4', got '1 2 9 4'" in c.detail(g, answer([1, 2, 9, 4], [5.0] * 4))


def test_a_short_answer_is_a_mismatch() -> None:
    g = answer([1, 2, 3, 4], [5.0] * 4)
    assert not q.compare(g, answer([1, 2], [5.0, 5.0])).match


def test_after_a_near_tie_nothing_is_compared() -> None:
    # Position 2 was a near tie when learned: a radix-cache hit may take the runner-up there,
    # and everything after it may differ.
    g = answer([1, 2, 3, 4, 5], [5.0, 5.0, 0.2, 5.0, 5.0], top2=[0, 0, 7, 0, 0])
    got = answer([1, 2, 7, 8, 9], [5.0] * 5)
    c = q.compare(g, got)
    assert c.match and c.checked == 2


def test_at_the_near_tie_a_third_token_is_a_mismatch() -> None:
    g = answer([1, 2, 3, 4], [5.0, 5.0, 0.2, 5.0], top2=[0, 0, 7, 0])
    assert not q.compare(g, answer([1, 2, 42, 4], [5.0] * 4)).match


def test_a_flat_golden_is_weak_but_its_first_tie_needs_one_of_its_two_candidates() -> None:
    g = answer([1, 2, 3], [0.01, 5.0, 5.0], top2=[7, 0, 0])
    other_weights = q.compare(g, answer([9, 9, 9], [0.0] * 3))
    assert not other_weights.match and other_weights.weak and other_weights.checked == 0
    assert other_weights.first_diff == 0
    swapped_tie = q.compare(g, answer([7, 8, 9], [0.0] * 3))
    assert swapped_tie.match and swapped_tie.weak
    assert q.compare(g, g).match


def test_a_golden_without_a_runner_up_compares_nothing() -> None:
    g = Answer(text="1 2 3", tokens=(1, 2, 3), margins=(None, None, None), top2=(None, None, None))
    c = q.compare(g, answer([9, 9, 9], [0.0] * 3))
    assert c.match and c.weak and c.checked == 0


def test_unknown_margin_ends_the_compared_prefix() -> None:
    g = answer([1, 2, 3, 4], [5.0, 5.0, None, 5.0])
    assert q.checked_prefix(g) == 2


def sglang_answer(tokens: list[int], lps: list[tuple[float, float]], **meta: object) -> bytes:
    """A /generate answer with return_logprob and top_logprobs_num 2, as SGLang 0.5.23 sends
    it (tokenizer_manager.py detokenize_logprob_tokens: [logprob, token_id, text|null])."""
    return json.dumps(
        {
            "text": "abc",
            "meta_info": {
                "completion_tokens": len(tokens),
                "output_token_logprobs": [
                    [a, t, None] for t, (a, _) in zip(tokens, lps, strict=True)
                ],
                "output_top_logprobs": [
                    [[a, t, None], [b, t + 1, None]] for t, (a, b) in zip(tokens, lps, strict=True)
                ],
                **meta,
            },
        }
    ).encode()


def test_parse_answer_reads_tokens_margins_and_speed() -> None:
    got = q.parse_answer(
        sglang_answer([5, 6], [(-0.1, -4.1), (-1.0, -1.5)], decode_throughput=42.0)
    )
    assert isinstance(got, Answer)
    assert got.tokens == (5, 6)
    assert got.margins == pytest.approx((4.0, 0.5))
    assert got.top2 == (6, 7)
    assert got.tokens_per_second == 42.0 and got.server_measured


def test_parse_answer_measures_speed_without_metrics() -> None:
    got = q.parse_answer(sglang_answer([5, 6], [(-0.1, -4.1)] * 2), elapsed_s=0.5)
    assert isinstance(got, Answer)
    assert got.tokens_per_second == pytest.approx(4.0) and not got.server_measured


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"[]",
        b"nope",
        b'{"text": 1}',
        b'{"text": "", "meta_info": {}}',
        b"\xff" * 10,
        b'{"text": "", "meta_info": {"output_token_logprobs": [[0.1]]}}',
        b"[" * 100000,
    ],
)
def test_parse_answer_never_raises(body: bytes) -> None:
    assert isinstance(q.parse_answer(body), str)


def test_answer_round_trips_and_rejects_damage() -> None:
    a = answer([1, 2], [3.0, None])
    assert Answer.from_json(json.loads(json.dumps(a.to_json()))) == a
    for bad in (
        None,
        [],
        {"text": "x"},
        {**a.to_json(), "margins": [1.0]},
        {**a.to_json(), "tokens": ["a", "b"]},
    ):
        assert Answer.from_json(bad) is None


# ------------------------------------------------------------------------------ speed


def test_slow_decode_needs_consecutive_slow_samples_and_recovers() -> None:
    w = q.SpeedWatch()
    for _ in range(q.BASELINE_SAMPLES):
        assert not w.add(100.0, busy=False)
    assert not w.add(30.0, busy=False) and not w.add(30.0, busy=False)
    assert not w.add(80.0, busy=False)  # one good sample restarts the count
    changes = [w.add(30.0, busy=False) for _ in range(q.SLOW_COUNT)]
    assert changes == [False, False, True] and w.slow
    assert not w.add(60.0, busy=False) and w.slow  # between the ratios: stays slow
    changes = [w.add(90.0, busy=False) for _ in range(q.SLOW_COUNT)]
    assert changes[-1] and not w.slow


def test_busy_samples_are_not_judged() -> None:
    w = q.SpeedWatch()
    for _ in range(q.BASELINE_SAMPLES):
        w.add(100.0, busy=False)
    for _ in range(10):
        assert not w.add(5.0, busy=True)
    assert not w.slow and w.last == 5.0


def test_a_launch_slow_from_its_start_is_slow_against_the_golden() -> None:
    w = q.SpeedWatch(golden_tps=100.0)
    changes = [w.add(20.0, busy=False) for _ in range(q.SLOW_COUNT)]
    assert changes[-1] and w.slow
    # A wall-clock measure (prefill included) is not held against the golden.
    w2 = q.SpeedWatch(golden_tps=100.0)
    assert not any(w2.add(20.0, busy=False, server_measured=False) for _ in range(10))


# ------------------------------------------------------------------------------ speculation


def test_accept_length_from_meta() -> None:
    assert q.accept_length({"spec_accept_length": 2.5}) == 2.5
    assert q.accept_length({"spec_verify_ct": 4, "completion_tokens": 8}) == 2.0
    assert q.accept_length({"completion_tokens": 8}) is None
    assert q.accept_length({"spec_verify_ct": True, "completion_tokens": 8}) is None


def test_spec_collapse_needs_two_judgements_and_clears() -> None:
    w = q.SpecWatch(floor=1.3)
    assert not w.add(1.0, None)
    assert w.add(1.0, None) and w.collapsed
    # The window's mean is 1.67 then: above the floor, so it clears.
    assert w.add(3.0, None) and not w.collapsed
    w2 = q.SpecWatch(floor=1.3)
    assert not w2.add(2.5, None) and not w2.add(2.7, None) and not w2.collapsed


def test_the_gauge_wins_over_short_probes() -> None:
    w = q.SpecWatch(floor=1.3)
    w.add(1.0, 2.8)
    w.add(1.0, 2.8)
    assert not w.collapsed and w.value == 2.8


def test_parse_gauge() -> None:
    text = (
        "# HELP sglang:spec_accept_length x\n"
        'sglang:spec_accept_length{model_name="m",engine_type="unified"} 1.5\n'
        "sglang:spec_accept_length_other 9\n"
        'sglang:num_running_reqs{model_name="m"} 2.0\n'
    )
    assert q.parse_gauge(text) == 1.5
    assert q.parse_gauge(text, "sglang:num_running_reqs") == 2.0
    assert q.parse_gauge("garbage { 1 2") is None


# ------------------------------------------------------------------------------ graphs


LINE = (
    "[2026-12-01 21:00:00 TP0] Decode batch, #running-req: {n}, #token: 120, token usage: 0.01, "
    "{dev} graph: {used}, gen throughput (token/s): 88.00, #queue-req: 0"
)


def test_decode_graph_reads_sglang_lines() -> None:
    assert q.decode_graph(LINE.format(n=1, dev="cuda", used=False)) == (1, "cuda", False)
    assert q.decode_graph(LINE.format(n=3, dev="cpu", used=True)) == (3, "cpu", True)
    assert q.decode_graph("Prefill batch, #new-seq: 1") is None


# The reading as one regex (what decode_graph reads with substring searches, for speed).
_DECODE_REGEX = re.compile(
    r"Decode batch[^\n]*?#running-req:\s*(\d+)[^\n]*?\b(cuda|cpu|npu|musa) graph:\s*(True|False)"
)
_FILLER = st.sampled_from(["", " ", ", ", "#token: 9, ", "x", "é", " graph: True, "])
_LINES = st.tuples(
    st.sampled_from(["", "[TP0] "]),
    st.sampled_from(["Decode batch", "Prefill batch", ""]),
    _FILLER,
    st.sampled_from(["#running-req:", "#running-req", ""]),
    st.sampled_from([" 3", "12", " x", ""]),
    _FILLER,
    st.sampled_from(["cuda", "cpu", "npu", "musa", "xcuda", "_npu", "gpu", " cuda", ""]),
    st.sampled_from([" graph:", " graph: ", "graph:", ""]),
    st.sampled_from(["True", "False", " True", "Maybe"]),
    _FILLER,
).map("".join)


@given(_LINES)
@settings(max_examples=400, deadline=None)
def test_decode_graph_reads_what_the_regex_reads(line: str) -> None:
    m = _DECODE_REGEX.search(line)
    want = None if m is None else (int(m.group(1)), m.group(2), m.group(3) == "True")
    assert q.decode_graph(line) == want


def test_no_cuda_graph_after_consecutive_small_batches() -> None:
    w = q.GraphWatch(expected=True)
    no = LINE.format(n=1, dev="cuda", used=False)
    assert [w.feed(no) for _ in range(q.GRAPH_COUNT)] == [False, False, True]
    assert w.feed(LINE.format(n=1, dev="cuda", used=True)) and not w.missing


def test_large_batches_cpu_and_disabled_graphs_are_not_judged() -> None:
    w = q.GraphWatch(expected=True)
    for _ in range(10):
        w.feed(LINE.format(n=q.GRAPH_MAX_RUNNING + 1, dev="cuda", used=False))
        w.feed(LINE.format(n=1, dev="cpu", used=False))
    assert not w.missing
    off = q.GraphWatch(expected=False)
    for _ in range(10):
        off.feed(LINE.format(n=1, dev="cuda", used=False))
    assert not off.missing and off.seen == 10


# ------------------------------------------------------------------------------ identity


def safetensors(path: Path, header: dict[str, object], data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_identity_follows_content_not_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import supervisor.quality.golden as cs

    monkeypatch.setattr(cs, "SMALL_FILE_BYTES", 1024)  # the weights file counts as large
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "config.json").write_text('{"x": 1}')
        safetensors(d / "model.safetensors", {"w": {"dtype": "BF16"}}, bytes(range(256)) * 64)
    assert model_identity(str(a)) == model_identity(str(b))
    # Other weights of the same shapes and size: a sample sees them.
    safetensors(b / "model.safetensors", {"w": {"dtype": "BF16"}}, bytes(reversed(range(256))) * 64)
    assert model_identity(str(a)) != model_identity(str(b))
    (tmp_path / "c").mkdir()
    assert model_identity(str(tmp_path / "c")) != model_identity(str(a))
    assert model_identity("org/hub-model") != model_identity("org/other")


def test_store_learn_accept_forget(tmp_path: Path) -> None:
    store = CanaryStore(str(tmp_path / "canary"))
    key = golden_key("id", "0.5.23", "prompt", 16)
    g = Golden(key, answer([1, 2], [5.0, 5.0]), "/m", "id", "0.5.23", "prompt", 16, 1.0, "learned")
    assert store.golden(key) is None and store.accept() is None
    store.save_golden(g)
    assert store.golden(key) == g
    store.save_last(dataclasses.replace(g, answer=answer([3, 4], [5.0, 5.0]), how="received"))
    accepted = store.accept()
    assert accepted is not None and accepted.how == "accepted"
    assert store.golden(key) is not None and store.golden(key).answer.tokens == (3, 4)  # type: ignore[union-attr]
    # forget also forgets the received answer: accept cannot put it back.
    assert store.forget() == [f"golden-{key}.json", "last.json"]
    assert store.last() is None and store.accept() is None
    assert store.golden(key) is None
    (tmp_path / "canary" / f"golden-{key}.json").write_text("{not json")
    assert store.golden(key) is None and store.goldens() == []


# ------------------------------------------------------------------------------ machine


MISMATCH = "token 0 of 16 confident ones differs: expected 'a', got 'b'"


def test_readiness_probe_carries_the_canary() -> None:
    d = Drive().loading()
    probes = [a for a in d.send(PortOpen(d.launch)) if isinstance(a, StartProbe)]
    assert len(probes) == 1 and probes[0].canary
    off = with_canary(enabled=False)
    d = Drive(off).loading()
    probes = [a for a in d.send(PortOpen(d.launch)) if isinstance(a, StartProbe)]
    assert len(probes) == 1 and not probes[0].canary


def test_gate_mismatch_is_never_ready_and_counts_towards_the_crash_loop() -> None:
    d = Drive(make_cfg(max_restarts=2)).warming()
    actions = d.send(
        ProbeDone(d.launch, ProbeKind.READINESS, ok_result(), canary_mismatch=MISMATCH), after=1
    )
    assert d.state is State.RESTARTING
    assert any(isinstance(a, StopChild) and not a.graceful for a in actions)
    gone = d.send(ChildGone(d.launch, None, 9), after=1)
    assert RecordRestart(Reason.CANARY_MISMATCH, None, 9, MISMATCH) in gone
    # The second mismatch reaches max_restarts: the fallback profile is next.
    d.send(TimerFired(TimerName.BACKOFF, d.launch), after=10)
    d.send(HostReady())
    d.send(Launched(d.launch, 4242), after=1)
    d.send(PortOpen(d.launch), after=1)
    d.send(ProbeDone(d.launch, ProbeKind.READINESS, ok_result(), canary_mismatch=MISMATCH))
    gone = d.send(ChildGone(d.launch, None, 9), after=1)
    assert ProfileChanged("primary", FALLBACK) in gone
    assert d.state is State.RESTARTING


def test_alert_mismatch_is_ready() -> None:
    d = Drive(with_canary(policy="alert")).warming()
    d.send(ProbeDone(d.launch, ProbeKind.READINESS, ok_result(), canary_mismatch=MISMATCH))
    assert d.state is State.READY


def test_canary_rides_the_first_liveness_probe_after_the_interval() -> None:
    d = Drive().ready()
    interval = CFG.quality.canary.interval

    def liveness(after: float) -> StartProbe:
        (p,) = [
            a
            for a in d.send(TimerFired(TimerName.LIVENESS, d.launch), after=after)
            if isinstance(a, StartProbe)
        ]
        d.send(ProbeDone(d.launch, ProbeKind.LIVENESS, ok_result()), after=0.5)
        return p

    assert not liveness(15).canary
    assert liveness(interval).canary
    assert not liveness(15).canary


def test_serving_mismatch_is_reported_not_restarted() -> None:
    d = Drive().ready()
    d.send(TimerFired(TimerName.LIVENESS, d.launch), after=15)
    actions = d.send(
        ProbeDone(d.launch, ProbeKind.LIVENESS, ok_result(), canary_mismatch=MISMATCH), after=1
    )
    assert d.state is State.READY
    assert not any(isinstance(a, StopChild) for a in actions)


def test_spec_collapse_falls_back_only_when_configured() -> None:
    d = Drive().ready()
    assert d.send(SpecCollapsed(d.launch, "mean accept length 1.00")) == []
    cfg = dataclasses.replace(
        CFG, quality=dataclasses.replace(CFG.quality, on_spec_collapse="fallback")
    )
    d = Drive(cfg).ready()
    actions = d.send(SpecCollapsed(d.launch, "mean accept length 1.00"), after=1)
    assert ProfileChanged("primary", FALLBACK) in actions
    assert d.state is State.RESTARTING and d.m.ctx.pending is Reason.SPEC_COLLAPSE
    assert d.m.ctx.profile == FALLBACK
    # Stale: a collapse of the old launch is ignored.
    assert d.send(SpecCollapsed(d.launch - 1, "old")) == []


def test_past_a_tie_the_answer_kept_it_is_still_compared() -> None:
    # Position 1 was a near tie and the answer kept the golden's token: the context is the
    # same, so position 2 (confident) must come back, and position 3 (a tie) needs one of
    # its two candidates.
    g = answer([1, 2, 3, 4, 5], [5.0, 0.1, 5.0, 0.1, 5.0], top2=[0, 8, 0, 9, 0])
    assert not q.compare(g, answer([1, 2, 42, 4, 5], [5.0] * 5)).match
    assert q.compare(g, answer([1, 2, 3, 9, 77], [5.0] * 5)).match
    late = q.compare(g, answer([1, 2, 3, 42, 5], [5.0] * 5))
    assert not late.match and late.first_diff == 3


# ------------------------------------------------------------------------------ the watch


def _canary_body(tps: float) -> bytes:
    """SGLang's /generate answer to the canary request: 4 tokens, each confident."""
    out = [[-0.01, t, None] for t in (11, 12, 13, 14)]
    tops = [[[-0.01, t, None], [-6.0, 99, None]] for t in (11, 12, 13, 14)]
    meta = {
        "output_token_logprobs": out,
        "output_top_logprobs": tops,
        "completion_tokens": 4,
        "decode_throughput": tps,
    }
    return json.dumps({"text": "a b c d", "meta_info": meta}).encode()


class _Server:
    """A /generate (the canary) and /metrics (the decode counter and running requests) whose
    speed and load a test sets between probes."""

    def __init__(self) -> None:
        self.tps = 100.0
        self.decoded = 0.0
        self.running = 0
        self.others_per_canary = 0.0  # decode tokens of other requests beside each canary

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            self.decoded += 4 + self.others_per_canary
            return httpx.Response(200, stream=httpx.ByteStream(_canary_body(self.tps)))
        if request.url.path == "/metrics":
            text = (
                f'sglang:realtime_tokens_total{{mode="decode"}} {self.decoded}\n'
                f"sglang:num_running_reqs {self.running}\n"
            )
            return httpx.Response(200, stream=httpx.ByteStream(text.encode()))
        return httpx.Response(404)


async def _watch_rounds(tmp_path: Path, rounds: list[tuple[float, float, int]]) -> list[bool]:
    """One canary probe per round (canary speed, others' decode tokens, running requests after
    it), as the daemon runs them; whether slow_decode was held after each."""
    server = _Server()
    cfg = dataclasses.replace(CFG, state_dir=str(tmp_path))
    spec = LaunchSpec("primary", ("python", "-m", "sglang.launch_server"), {}, {})
    held = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
        watch = QualityWatch(cfg, http, Metrics(), emit=lambda _: None)
        watch.launched(1, spec)
        for tps, others, running in rounds:
            server.tps, server.others_per_canary = tps, others
            before = Progress(None, 0.0, server.decoded, 0.0, server.decoded)
            assert await watch.canary(1, ProbeGate()) == CanaryOutcome()
            server.running = running
            # A probe without SGLang's measured speed: only the canary's sample is judged.
            done = ProbeDone(1, ProbeKind.LIVENESS, ok_result(0))
            await watch.probe_done(done, before.realtime_decode, own_tokens=4)
            held.append(q.SLOW_DECODE in watch.degraded())
    return held


async def test_a_canary_slowed_by_other_requests_is_not_slow_decode(tmp_path: Path) -> None:
    idle = [(100.0, 0.0, 0)] * q.BASELINE_SAMPLES
    # A third of the speed while other requests decode beside it, or run on after it.
    loaded = [(30.0, 50.0, 0), (30.0, 0.0, 2)] * q.SLOW_COUNT
    assert not any(await _watch_rounds(tmp_path / "a", idle + loaded))
    # The same speeds at idle: slow decoding, reported after SLOW_COUNT samples.
    alone = [(30.0, 0.0, 0)] * q.SLOW_COUNT
    assert await _watch_rounds(tmp_path / "b", idle + alone) == [False] * (
        q.BASELINE_SAMPLES + q.SLOW_COUNT - 1
    ) + [True]
