"""Grafana dashboard and rules: every metric name they query must exist.

A renamed metric does not break a dashboard loudly: the panel just goes empty,
usually discovered during an incident. So every PromQL expression in the
dashboard (panel targets, annotations, variable queries) and in the Prometheus
rules is tokenised, and each metric name is checked against the series
kimi-serve exports (`known_kimi_series()`) and the SGLang metric names below.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import run_promtool

# --- what exists --------------------------------------------------------------

# The contract's metrics (shared design contract, "Prometheus metrics"), with
# their types: the type decides which series a scrape shows.
CONTRACT_METRICS: dict[str, str] = {
    "kimi_serve_state": "gauge",
    "kimi_serve_ready": "gauge",
    "kimi_serve_restarts_total": "counter",
    "kimi_serve_child_starts_total": "counter",
    "kimi_serve_probe_duration_seconds": "histogram",
    "kimi_serve_probe_failures_total": "counter",
    "kimi_serve_last_load_duration_seconds": "gauge",
    "kimi_serve_child_start_time_seconds": "gauge",
    "kimi_serve_gpu_leftover_processes_killed_total": "counter",
    "kimi_serve_gpu_memory_release_seconds": "gauge",
    "kimi_serve_profile_info": "gauge",
    "kimi_serve_build_info": "gauge",
    "kimi_serve_log_lines_total": "counter",
    # The contract's GPU fitness section.
    "kimi_serve_gpu_healthy": "gauge",
    "kimi_serve_gpu_xid_events_total": "counter",
    # Incidents section of the contract.
    "kimi_serve_load_phase_seconds": "gauge",
    # Serving quality section of the contract.
    "kimi_serve_canary_ok": "gauge",
    "kimi_serve_spec_accept_length": "gauge",
    "kimi_serve_decode_tokens_per_second": "gauge",
    "kimi_serve_quality_degraded": "gauge",
    # Restart downtime section of the contract.
    "kimi_serve_restart_downtime_seconds": "histogram",
}


def series_names(name: str, kind: str) -> set[str]:
    """Sample names a metric family shows in the text exposition format."""
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    if kind == "summary":
        return {name, f"{name}_sum", f"{name}_count"}
    if kind == "counter":
        return {name if name.endswith("_total") else f"{name}_total"}
    return {name}


def series_from_exposition(text: str) -> set[str]:
    """Sample names in a /metrics body (for a live scrape of `kimi-serve demo`)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def known_kimi_series() -> set[str]:
    """Every kimi_serve_* series name dashboards and alerts may query.

    For now: the contract's list, expanded by type. To check against what the
    daemon really exports, replace the body with a scrape of the demo, e.g.
    ``return series_from_exposition(scrape_demo_metrics())``; nothing else in
    this module needs to change.
    """
    return set().union(*(series_names(n, k) for n, k in CONTRACT_METRICS.items()))


# SGLang's own /metrics (with --enable-metrics), from
# sgl-project/sglang python/sglang/srt/metrics/collector.py
# (SchedulerMetricsCollector, TokenizerMetricsCollector; read at commit
# 00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538) and docs/references/production_metrics.md.
# Labels: model_name, tp_rank, ... Histograms listed by family; series_names() expands.
SGLANG_METRICS: dict[str, str] = {
    "sglang:num_running_reqs": "gauge",
    "sglang:num_used_tokens": "gauge",
    "sglang:token_usage": "gauge",
    "sglang:gen_throughput": "gauge",
    "sglang:num_queue_reqs": "gauge",
    "sglang:cache_hit_rate": "gauge",
    "sglang:max_total_num_tokens": "gauge",
    "sglang:spec_accept_length": "gauge",
    "sglang:spec_accept_rate": "gauge",
    "sglang:utilization": "gauge",
    "sglang:engine_startup_time": "gauge",
    "sglang:engine_load_weights_time": "gauge",
    "sglang:is_cuda_graph": "gauge",
    "sglang:queue_time_seconds": "histogram",
    "sglang:prompt_tokens_total": "counter",
    "sglang:generation_tokens_total": "counter",
    "sglang:realtime_tokens_total": "counter",
    "sglang:cached_tokens_total": "counter",
    "sglang:num_requests_total": "counter",
    "sglang:num_aborted_requests_total": "counter",
    "sglang:num_retracted_requests_total": "counter",
    "sglang:time_to_first_token_seconds": "histogram",
    "sglang:inter_token_latency_seconds": "histogram",
    "sglang:e2e_request_latency_seconds": "histogram",
}


def known_sglang_series() -> set[str]:
    return set().union(*(series_names(n, k) for n, k in SGLANG_METRICS.items()))


# Series Prometheus makes itself.
PROMETHEUS_SERIES = {"up"}

# --- a small PromQL tokenizer ----------------------------------------------------

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.I)
_DURATION = re.compile(r"(?<![\w:.])(?:\d+(?:ms|[smhdwy]))+\b")
_NUMBER = re.compile(
    r"(?<![\w:.])(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?![\w:])"
)
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression.

    Identifiers, minus what is not a metric: strings, label matchers in braces,
    ranges in brackets, label lists of by/without/on/ignoring/group_*, numbers
    and durations, function names (an identifier followed by `(`) and keywords.
    Names may contain `:` (recording rules, SGLang's `sglang:` prefix).
    """
    text = _STRING.sub(" ", expr)
    text = _GRAFANA_VAR.sub(" ", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    text = _DURATION.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group()
        if word.lower() in _KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue
        names.add(word)
    return names


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


def walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))  # rows, collapsed or not


def dashboard_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every query in the dashboard."""
    found = []
    for panel in walk_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for note in dashboard.get("annotations", {}).get("list", []):
        if "expr" in note:
            found.append((f"annotation {note['name']!r}", note["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        # Grafana's label_values(<selector>, <label>) takes a series selector.
        m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query)
        found.append((f"variable ${var['name']}", m.group(1) if m else query))
    return found


def rules_exprs(rules: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (f"rule {r.get('alert') or r.get('record')}", r["expr"])
        for g in rules["groups"]
        for r in g["rules"]
    ]


def unknown_names(exprs: list[tuple[str, str]], known: set[str]) -> list[str]:
    problems = []
    for where, expr in exprs:
        for name in sorted(metric_names(expr)):
            if name not in known:
                problems.append(f"{where}: {name}")
    return problems


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
    from tests.observability.test_rules import RUNBOOK_DEFAULT_URL

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
