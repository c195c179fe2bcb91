"""Verified changes, the machine's part: the gate fails closed (a canary with no answer is
asked again a bounded number of times, then `canary_unavailable`), and a canary with no answer
while serving is reported only."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import pytest

from supervisor import config, threads
from supervisor import quality as q
from supervisor.config import ConfigError
from supervisor.core.context import CANARY_TRIES
from supervisor.core.machine import (
    ChildGone,
    HostReady,
    Launched,
    PortOpen,
    ProbeDone,
    ProbeKind,
    Reason,
    RecordRestart,
    SetTimer,
    StartProbe,
    State,
    StopChild,
    TimerFired,
    TimerName,
    Transitioned,
)
from supervisor.daemon.quality_watch import changed
from supervisor.quality import Answer
from supervisor.quality.golden import CanaryStore, Golden, golden_key, layout
from testkit.machine import Drive, make_cfg, ok_result, with_canary

REPO = Path(__file__).resolve().parents[2]
NO_ANSWER = "no canary answer within 5s"
KEY = golden_key("id", "0.5.23", "p", 16)


def _no_canary(d: Drive, kind: ProbeKind = ProbeKind.READINESS) -> list[object]:
    done = ProbeDone(d.launch, kind, ok_result(), canary_unavailable=NO_ANSWER)
    return list(d.send(done, after=1))


def _retry(d: Drive) -> StartProbe:
    (probe,) = [
        a
        for a in d.send(TimerFired(TimerName.PROBE_RETRY, d.launch), after=0.25)
        if isinstance(a, StartProbe)
    ]
    return probe


def test_gate_asks_again_then_restarts_as_canary_unavailable() -> None:
    d = Drive(make_cfg(max_restarts=5)).warming()
    for n in range(1, CANARY_TRIES):
        actions = _no_canary(d)
        assert d.state is State.WARMING, "never ready without evidence"
        detail = f"{NO_ANSWER} ({n}/{CANARY_TRIES})"
        assert Transitioned(State.WARMING, State.WARMING, Reason.CANARY_UNAVAILABLE, detail) in (
            actions
        )
        assert any(isinstance(a, SetTimer) and a.name is TimerName.PROBE_RETRY for a in actions)
        assert _retry(d).canary, "the next readiness probe carries the canary again"
    actions = _no_canary(d)
    assert d.state is State.RESTARTING
    assert any(isinstance(a, StopChild) and not a.graceful for a in actions)
    gone = d.send(ChildGone(d.launch, None, 9), after=1)
    detail = f"{NO_ANSWER} ({CANARY_TRIES}/{CANARY_TRIES})"
    assert RecordRestart(Reason.CANARY_UNAVAILABLE, None, 9, detail) in gone
    assert len(d.m.ctx.restarts) == 1, "counted towards the crash loop"


def test_the_tries_start_again_with_every_launch() -> None:
    d = Drive(make_cfg(max_restarts=5)).warming()
    for _ in range(CANARY_TRIES):
        _no_canary(d)
        if d.state is State.WARMING:
            _retry(d)
    d.send(ChildGone(d.launch, None, 9), after=1)
    d.send(TimerFired(TimerName.BACKOFF, d.launch), after=10)
    d.send(HostReady())
    d.send(Launched(d.launch, 4242), after=0.1)
    d.send(PortOpen(d.launch), after=1)
    _no_canary(d)
    assert d.state is State.WARMING and d.m.ctx.canary_tries == 1


def test_a_canary_answer_after_a_miss_makes_ready() -> None:
    d = Drive().warming()
    _no_canary(d)
    _retry(d)
    d.send(ProbeDone(d.launch, ProbeKind.READINESS, ok_result()), after=1)
    assert d.state is State.READY


def test_alert_is_ready_without_a_canary_answer() -> None:
    d = Drive(with_canary(policy="alert")).warming()
    _no_canary(d)
    assert d.state is State.READY


def test_serving_canary_timeout_is_reported_not_restarted() -> None:
    d = Drive().ready()
    d.send(TimerFired(TimerName.LIVENESS, d.launch), after=15)
    for _ in range(CANARY_TRIES + 1):
        actions = _no_canary(d, ProbeKind.LIVENESS)
        assert d.state is State.READY
        assert not any(isinstance(a, StopChild) for a in actions)


# ------------------------------------------------------------------------------ known answers


def test_known_answers_parse_and_a_bad_one_names_its_key_and_line() -> None:
    text = (
        "sglang: {model_path: /m}\n"
        "quality:\n"
        "  known_answers:\n"
        "    - {prompt: 'The capital of France is', expect: Paris}\n"
    )
    cfg = config.parse(text, "c.yaml")
    assert cfg.quality.known_answers == (("The capital of France is", "Paris"),)
    with pytest.raises(ConfigError) as info:
        config.parse(text + "    - {prompt: two}\n", "c.yaml")
    [issue] = info.value.issues
    assert issue.path == "quality.known_answers" and issue.line == 3  # the key's line
    assert "item 1 must be a mapping of exactly prompt and expect" in issue.message


def test_the_shipped_examples_parse_once_uncommented() -> None:
    text = (REPO / "etc" / "kimi-serve.yaml").read_text()
    block = text[text.index("#quality:") :].split("\n\n")[0]
    uncommented = text.replace(block, "\n".join(line[1:] for line in block.splitlines()))
    cfg = config.parse(uncommented, "kimi-serve.yaml")
    assert len(cfg.quality.known_answers) == 3


def test_an_answer_holds_when_it_begins_with_the_expected_text() -> None:
    assert q.holds("Paris", " Paris, the city of light")
    assert q.holds(" Paris", "Paris")
    assert not q.holds("Paris", " paris")
    assert not q.holds("Paris", " The city of Paris")
    assert not q.KnownResult("p", "Paris", None, "timed out").ok
    assert q.known_tokens("Paris") == 9 and q.known_tokens("x" * 400) == 256
    assert q.known_tokens("東京") == 10  # a token is at least one byte, not one character


# ------------------------------------------------------------------------------ golden store


def _golden(text: str, generation: int) -> Golden:
    a = Answer(text, (1, 2), (5.0, 5.0), (3, 4))
    return Golden(KEY, a, "/m", "id", "0.5.23", "p", 16, 1.0, "learned", generation=generation)


def test_a_write_abandoned_at_its_deadline_never_lands_after_a_newer_one(tmp_path: Path) -> None:
    store = CanaryStore(str(tmp_path / "canary"))
    store.save_golden(_golden(" new", generation=2))
    store.save_golden(_golden(" old", generation=1))  # asked for first, finished last
    assert store.golden(KEY) == _golden(" new", generation=2)
    assert [p.name for p in (tmp_path / "canary").iterdir()] == [f"golden-{KEY}.json"]
    store.save_golden(_golden(" newer", generation=3))
    assert store.golden(KEY) == _golden(" newer", generation=3)


async def test_the_daemons_store_call_is_abandoned_at_its_deadline_and_lands_nothing(
    tmp_path: Path,
) -> None:
    # A write stuck in the file system (a hung mount): the call gives up at its deadline; the
    # newer write lands, and the stuck one, released afterwards, cannot replace it.
    store = CanaryStore(str(tmp_path / "canary"))
    release, entered, finished = threading.Event(), threading.Event(), threading.Event()
    old = _golden(" old", generation=time.time_ns())

    def stuck() -> None:
        entered.set()
        release.wait(10)
        try:
            store.save_golden(old)
        finally:
            finished.set()

    with pytest.raises(TimeoutError):
        await threads.in_thread(stuck, 0.2)
    assert entered.is_set() and not finished.is_set()
    new = _golden(" new", generation=time.time_ns())
    await threads.in_thread(lambda: store.save_golden(new), 5)
    release.set()
    assert await asyncio.get_running_loop().run_in_executor(None, finished.wait, 10)
    assert store.golden(KEY) == new
    assert [p.name for p in (tmp_path / "canary").iterdir()] == [f"golden-{KEY}.json"]


def test_the_layout_is_part_of_the_key_and_named_when_it_changed() -> None:
    args = {"tp-size": 8, "speculative-algorithm": "EAGLE3", "mem-fraction-static": 0.9}
    assert layout(args) == "tp-size=8 speculative-algorithm=EAGLE3"
    assert layout({"speculative-algorithm": None, "enable-dp-attention": False}) == ""
    plain = golden_key("id", "0.5.23", "p", 16)
    assert golden_key("id", "0.5.23", "p", 16, "") == plain, "no layout: the key it had"
    assert golden_key("id", "0.5.23", "p", 16, layout(args)) != plain
    old = dataclasses.replace(_golden(" a", 1), layout=layout(args))
    new = dataclasses.replace(old, key="f" * 32, layout="tp-size=8", sglang_version="0.5.24")
    assert changed(old, new) == (
        "SGLang 0.5.23 -> 0.5.24, layout tp-size=8 speculative-algorithm=EAGLE3 -> tp-size=8 "
        f"changed, and the answer disagrees with the golden of {KEY}"
    )
    assert Golden.from_json(new.to_json()) == new
