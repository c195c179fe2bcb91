"""The metrics registry: series that exist from the first scrape, one-hot gauges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from supervisor.core.machine import Reason, State
from supervisor.metrics import Metrics


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_every_reason_exists_at_zero_before_any_restart() -> None:
    m = Metrics(CollectorRegistry())
    for reason in Reason:
        assert sample(m, "kimi_serve_restarts_total", reason=reason.value) == 0.0


def test_state_is_one_hot() -> None:
    m = Metrics(CollectorRegistry())
    m.set_state(State.DEGRADED, 1.0)
    values = {s: sample(m, "kimi_serve_state", state=s.value) for s in State}
    assert values.pop(State.DEGRADED) == 1.0 and set(values.values()) == {0.0}
    assert sample(m, "kimi_serve_ready") == 1.0
    m.set_state(State.RESTARTING, 2.0)
    assert sample(m, "kimi_serve_ready") == 0.0


def test_a_profile_removed_by_a_reload_does_not_stay_at_one() -> None:
    m = Metrics(CollectorRegistry())
    m.set_profile("fallback", ["primary", "fallback"])
    assert sample(m, "kimi_serve_profile_info", profile="fallback") == 1.0
    m.set_profile("primary", ["primary", "safe"])
    assert sample(m, "kimi_serve_profile_info", profile="fallback") is None
    assert sample(m, "kimi_serve_profile_info", profile="primary") == 1.0
    assert sample(m, "kimi_serve_profile_info", profile="safe") == 0.0


def test_the_sglang_version_label_is_bounded_and_printable() -> None:
    # SGLang's /server_info names its version; a hostile server could name a megabyte.
    m = Metrics(CollectorRegistry())
    m.set_sglang_version("0.5.23\n" + "x" * (1 << 20))
    text = m.render().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("kimi_serve_build_info{")]
    assert len(line) < 200 and 'sglang_version="0.5.23' in line, line[:300]


def test_counters_go_on_from_a_hand_over_and_garbage_is_skipped() -> None:
    old = Metrics()
    old.restarts.labels("manual").inc()
    old.child_starts.inc(2)
    old.handoffs.labels("ok").inc()  # carried apart, never twice
    carried = old.counters()
    assert ["kimi_serve_restarts", {"reason": "manual"}, 1.0] in carried
    assert not [c for c in carried if c[0] == "kimi_serve_handoffs"]
    new = Metrics()
    hostile = [
        ["kimi_serve_restarts", {"reason": "manual", "extra": "x"}, 5.0],  # other labels
        ["kimi_serve_restarts", {"reason": 3}, 5.0],  # not a label value
        ["kimi_serve_child_starts", {}, float("nan")],
        ["kimi_serve_child_starts", {}, -4.0],
        ["kimi_serve_child_starts", {}, True],
        ["kimi_serve_no_such_metric", {}, 1.0],
        ["kimi_serve_ready", {}, 1.0],  # a gauge
        "not a series",
    ]
    assert new.continue_counters([*carried, *hostile]) == len(carried)
    assert new.continue_counters({"not": "a list"}) == 0
    assert new.restart_counts() == {"manual": 1}
    assert new.counters() == carried
