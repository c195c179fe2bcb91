"""Grafana dashboard and rules: every metric name they query must exist.

A renamed metric does not break a dashboard loudly: the panel just goes empty,
usually discovered during an incident. So every PromQL expression in the
dashboard (panel targets, annotations, variable queries) and in the Prometheus
rules is tokenised, and each metric name is checked against the series
kimi-serve exports (`known_kimi_series()`) and the SGLang metric names below.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.observability import (
    CONTRACT_METRICS,
    PROMETHEUS_SERIES,
    RUNBOOK_DEFAULT_URL,
    dashboard_exprs,
    known_kimi_series,
    known_sglang_series,
    metric_names,
    rules_exprs,
    run_promtool,
    series_from_exposition,
    series_names,
    unknown_names,
    walk_panels,
)

# --- what exists --------------------------------------------------------------


# --- a small PromQL tokenizer ----------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('up{job="kimi-serve"} == 0 or absent(up{job="kimi-serve"})', {"up"}),
        ('sum by (le) (rate(a_bucket{kind="liveness", le=~"1|2"}[5m]))', {"a_bucket"}),
        ("sum(rate(a_bucket[5m])) by (le, kind)", {"a_bucket"}),
        (
            "histogram_quantile(0.99, sum by (le) (rate(sglang:ttft_bucket[$__rate_interval])))",
            {"sglang:ttft_bucket"},
        ),
        ('time() - b{instance=~"$instance"}', {"b"}),
        ("a and on (instance, state) (max_over_time(b[$__range]) == 1)", {"a", "b"}),
        ("a * on (instance) group_left (profile) b", {"a", "b"}),
        ("a > bool 1e3 unless c offset 1h30m", {"a", "c"}),
        ("rate(a[5m:1m] @ end())", {"a"}),
        ("ns:rec_10m:p99 > 10", {"ns:rec_10m:p99"}),
        ('label_replace(x, "dst", "$1", "src", "(.*)")', {"x"}),
        ("-Inf < NaN", set()),
    ],
)
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


# --- where expressions live ------------------------------------------------------


# --- checks -----------------------------------------------------------------------


def test_dashboard_uses_only_known_metrics(dashboard: dict[str, Any]) -> None:
    exprs = dashboard_exprs(dashboard)
    assert len(exprs) > 15
    known = known_kimi_series() | known_sglang_series() | PROMETHEUS_SERIES
    problems = unknown_names(exprs, known)
    assert not problems, "unknown metric names:\n" + "\n".join(problems)


def test_rules_use_only_known_metrics(rules: dict[str, Any]) -> None:
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    known = known_kimi_series() | PROMETHEUS_SERIES | recorded
    problems = unknown_names(rules_exprs(rules), known)
    assert not problems, "unknown metric names:\n" + "\n".join(problems)


def test_unknown_names_are_reported() -> None:
    # The check above must be able to fail: a typo is caught.
    assert unknown_names([("x", "rate(kimi_serve_restart_total[5m])")], known_kimi_series())


def test_dashboard_shows_every_contract_metric(dashboard: dict[str, Any]) -> None:
    used = set().union(*(metric_names(e) for _, e in dashboard_exprs(dashboard)))
    unused = [
        name for name, kind in CONTRACT_METRICS.items() if not series_names(name, kind) & used
    ]
    assert not unused, f"contract metrics with no panel: {unused}"


def test_dashboard_shows_sglang_serving_metrics(dashboard: dict[str, Any]) -> None:
    used = set().union(*(metric_names(e) for _, e in dashboard_exprs(dashboard)))
    wanted = {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:spec_accept_length",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:generation_tokens_total",
        # What busy-vs-hung is judged on (docs/runbook.md "Busy or hung?").
        "sglang:realtime_tokens_total",
    }
    assert wanted - used == set()


def test_known_series_match_what_prometheus_client_exposes() -> None:
    """Expanding by type agrees with a real registry built to the contract.

    The same path a live scrape of the demo would take; catches e.g. a
    histogram listed as a gauge.
    """
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    for name, kind in CONTRACT_METRICS.items():
        if kind == "counter":
            Counter(name, name, registry=registry).inc()
        elif kind == "histogram":
            Histogram(name, name, registry=registry).observe(1)
        else:
            Gauge(name, name, registry=registry).set(1)
    scraped = series_from_exposition(generate_latest(registry).decode())
    scraped = {s for s in scraped if not s.endswith("_created")}
    assert known_kimi_series() == scraped


def test_dashboard_structure(dashboard: dict[str, Any]) -> None:
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] == "kimi-serve"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query"
    ids = [p["id"] for p in walk_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in walk_panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        where = f"panel {panel['title']!r}"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"}, where
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, where
        assert panel["targets"], where
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", where
            if "$instance" not in target["expr"] and "$sglang_instance" not in target["expr"]:
                pytest.fail(f"{where} {target['refId']}: not filtered by an instance variable")


def test_dashboard_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in walk_panels(dashboard["panels"]):
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                other = cells.setdefault((x, y), panel["title"])
                assert other == panel["title"], f"{panel['title']!r} overlaps {other!r}"


_GRAFANA_SUBSTITUTIONS = {
    "$__rate_interval": "5m",
    "$__range": "6h",
    "$__interval": "1m",
    "$sglang_instance": ".*",
    "$instance": ".*",
}


def test_dashboard_promql_parses(promtool: Path, dashboard: dict[str, Any], tmp_path: Path) -> None:
    """promtool parses every dashboard query (Grafana variables filled in)."""
    rules = []
    for i, (where, expr) in enumerate(dashboard_exprs(dashboard)):
        for var, value in _GRAFANA_SUBSTITUTIONS.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr, "labels": {"where": where}})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = run_promtool(promtool, "check", "rules", str(path))
    assert done.returncode == 0, textwrap.indent(done.stdout + done.stderr, "  ")


def test_dashboard_runbook_link_is_the_rules_default(dashboard: dict[str, Any]) -> None:
    """The dashboard's Runbook link is a setting (constant `runbook`) defaulting to the
    same page as every alert's runbook_url: the copy the package installs."""
    links = {link["title"]: link for link in dashboard["links"]}
    assert links["Runbook"]["url"] == "${runbook}"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["runbook"]["type"] == "constant"
    assert variables["runbook"]["query"] == RUNBOOK_DEFAULT_URL


def test_dashboard_shows_the_spec_accept_floor(dashboard: dict[str, Any]) -> None:
    # quality.spec_accept_floor's default (contract: 1.3) as the accept-length panel's line.
    panel = next(
        p
        for p in walk_panels(dashboard["panels"])
        if any("kimi_serve_spec_accept_length" in t["expr"] for t in p.get("targets", []))
    )
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["custom"]["thresholdsStyle"]["mode"].startswith("line")
    assert [s["value"] for s in defaults["thresholds"]["steps"]] == [None, 1.3]
