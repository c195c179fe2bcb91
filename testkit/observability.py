"""The shipped Prometheus rules, Grafana dashboard and runbook, as the tests read them.

- `run_promtool(promtool, *args)`: the real promtool (tools/get-promtool) in the repository.
- `metric_names(expr)`: the series names a PromQL expression queries; `dashboard_exprs`,
  `rules_exprs`, `unknown_names` check them against `known_kimi_series()` (what
  supervisor.metrics registers), `known_sglang_series()` and `PROMETHEUS_SERIES`.
- `series_from_exposition(text)`: the sample names of a /metrics body.
- `runbook_anchors`, `github_slug`, `unknown_runbook_anchors`: every alert's runbook_url lands
  on a heading of docs/runbook.md (`RUNBOOK_DEFAULT_URL`: where the package installs it).
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from testkit.paths import REPO_ROOT

TESTS_DIR = REPO_ROOT / "tests" / "observability"  # the promtool unit tests of the rules
RULES_FILE = REPO_ROOT / "etc" / "prometheus" / "kimi-serve-rules.yml"
RULES_TEST_FILE = TESTS_DIR / "kimi-serve-rules.test.yml"
# Every promtool test file: the main one, and the rules over days at a coarser interval.
RULES_TEST_FILES = sorted(TESTS_DIR.glob("*.test.yml"))
DASHBOARD_FILE = REPO_ROOT / "etc" / "grafana" / "kimi-serve.json"
RUNBOOK_FILE = REPO_ROOT / "docs" / "runbook.md"
GET_PROMTOOL = REPO_ROOT / "tools" / "get-promtool"


def run_promtool(promtool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(promtool), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


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
    # Hand-over section of the contract.
    "kimi_serve_handoffs_total": "counter",
    # Verified changes section of the contract (kimi_serve_lkg_serving: an addition, README).
    "kimi_serve_trial": "gauge",
    "kimi_serve_rollbacks_total": "counter",
    "kimi_serve_lkg_serving": "gauge",
}


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


def known_sglang_series() -> set[str]:
    return set().union(*(series_names(n, k) for n, k in SGLANG_METRICS.items()))


# Series Prometheus makes itself.
PROMETHEUS_SERIES = {"up"}
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


# Where the Debian package installs docs/runbook.md (packaging/debian/kimi-serve.docs, by
# dh_installdocs, left uncompressed by debian/rules), and so the link when the Prometheus
# server does not name the site's own copy in its external label `kimi_serve_runbook`.
RUNBOOK_SITE_LABEL = "kimi_serve_runbook"
RUNBOOK_INSTALLED = "/usr/share/doc/kimi-serve/runbook.md"
RUNBOOK_DEFAULT_URL = f"file://{RUNBOOK_INSTALLED}"
# Every alert's runbook_url: the site's runbook page, else the installed copy; then the anchor.
RUNBOOK_URL = re.compile(
    r"\{\{ or \$externalLabels\." + RUNBOOK_SITE_LABEL + r' "(?P<default>[^"]+)" \}\}'
    r"#(?P<anchor>[a-z0-9_-]+)"
)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading.

    Lower case; drop everything but letters, digits, spaces, hyphens and
    underscores (after removing inline markup); spaces become hyphens.
    """
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.strip().lower()
    kept = []
    for ch in text:
        if ch in " -_" or unicodedata.category(ch)[0] in "LN":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def runbook_anchors(markdown: str) -> set[str]:
    """Anchors of all ATX headings, with GitHub's -1, -2 suffixes for repeats."""
    anchors: set[str] = set()
    seen: Counter[str] = Counter()
    in_fence = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        match = None if in_fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = github_slug(match.group(1))
            anchors.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return anchors


def runbook_url_anchors(alert_rules: list[dict[str, Any]]) -> dict[str, str]:
    """alert -> the anchor its runbook_url ends with."""
    return {r["alert"]: r["annotations"]["runbook_url"].rsplit("#", 1)[1] for r in alert_rules}


def unknown_runbook_anchors(alert_rules: list[dict[str, Any]], markdown: str) -> list[str]:
    anchors = runbook_anchors(markdown)
    found = runbook_url_anchors(alert_rules).items()
    return [f"{alert}: #{anchor}" for alert, anchor in found if anchor not in anchors]
