"""daemon.handover's outcomes: `kimi_serve_handoffs_total` goes on over the exec (the counts
travel in the state, so a second fallback reads 1 -> 2, not 1 -> 1 that no increase() sees),
`last_handoff` says why, and an exec that does not happen after a 202 is `failed`, after an
internal error the old path (a clean stop)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from supervisor.core.events import StopRequested
from supervisor.daemon.handover import OUTCOMES, Handover
from supervisor.metrics import Metrics


def counts(m: Metrics) -> dict[str, float]:
    for fam in text_string_to_metric_families(m.render().decode()):
        if fam.name == "kimi_serve_handoffs":
            return {s.labels["outcome"]: s.value for s in fam.samples if s.name.endswith("_total")}
    raise AssertionError("no kimi_serve_handoffs_total")


def daemon(m: Metrics) -> Any:
    emitted: list[object] = []
    failed: list[bool] = []
    logged: list[tuple[str, dict[str, Any]]] = []
    return SimpleNamespace(
        metrics=m,
        emitted=emitted,
        failed=failed,
        logged=logged,
        emit=emitted.append,
        parts=SimpleNamespace(inbox=SimpleNamespace(failed=lambda: failed.append(True))),
        log=SimpleNamespace(error=lambda event, **kw: logged.append((event, kw))),
    )


def test_every_outcome_is_exported_at_zero() -> None:
    assert counts(Metrics()) == dict.fromkeys(OUTCOMES, 0.0)


def test_the_counts_go_on_over_the_exec() -> None:
    old = Handover(daemon(Metrics()))
    old.ended("fallback", None, "the configuration changes SGLang's command line")
    old.ended("ok", 1.5)
    # What state_of writes and the new program reads before /metrics is served.
    carried = dict(old.counted)
    new_metrics = Metrics()
    new = Handover(daemon(new_metrics))
    new.carried(carried)
    assert counts(new_metrics) == {"ok": 1.0, "fallback": 1.0, "failed": 0.0}
    new.ended("fallback", None, "a pipe closed")
    assert counts(new_metrics)["fallback"] == 2.0
    assert new.counted == {"ok": 1, "fallback": 2, "failed": 0}


def test_carried_counts_that_are_not_counts_are_ignored() -> None:
    m = Metrics()
    ho = Handover(daemon(m))
    for bad in (None, [], {"ok": -3, "fallback": True, "failed": "7"}, {"other": 5}):
        ho.carried(bad)
    assert counts(m) == dict.fromkeys(OUTCOMES, 0.0)


def test_last_handoff_says_why() -> None:
    ho = Handover(daemon(Metrics()))
    ho.ended("fallback", None, "the launch was loading, not serving")
    assert ho.last is not None
    assert ho.last["outcome"] == "fallback"
    assert ho.last["why"] == "the launch was loading, not serving"
    ho.ended("ok", 0.25)
    assert ho.last["why"] is None and ho.last["seconds"] == 0.25


def test_an_exec_that_did_not_happen_after_the_answer_is_failed() -> None:
    m = Metrics()
    d = daemon(m)
    ho = Handover(d)
    ho.begun = True
    ho.not_begun("a StopRequested came first")
    assert not ho.begun
    assert ho.last is not None and ho.last["outcome"] == "failed"
    assert ho.last["why"] == "a StopRequested came first"
    assert counts(m)["failed"] == 1.0
    assert d.emitted == [] and d.failed == []  # a request, not an internal error: goes on


def test_an_internal_error_whose_exec_did_not_happen_takes_the_old_path() -> None:
    d = daemon(Metrics())
    ho = Handover(d)
    ho.begun, ho.cause = True, KeyError("boom")
    ho.not_begun("the daemon hands over only while serving; it is restarting")
    assert d.failed == [True]  # the machine hears of it: exit 1
    assert d.emitted == [StopRequested("internal-error")]
    assert ho.cause is None
    assert d.logged and d.logged[0][0] == "internal error not handed over; stopping"
