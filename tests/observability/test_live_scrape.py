"""The metrics as the daemon really exports them: a live scrape of the real daemon (supervising
the stand-in, with simulated GPUs) checked by promtool and against the dashboard and rules."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from testkit import base_config, running
from testkit.observability import (
    PROMETHEUS_SERIES,
    dashboard_exprs,
    metric_names,
    rules_exprs,
    series_from_exposition,
    unknown_names,
)

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def live_scrape(tmp_path_factory: pytest.TempPathFactory) -> str:
    """/metrics of a daemon that has launched, been ready, restarted once and is ready again."""
    tmp = tmp_path_factory.mktemp("live")
    cfg = base_config(tmp, gpus={"manage": True})
    env = {"KIMI_SERVE_SIMULATED_GPUS": "2", "KIMI_SERVE_SIM_TAG": f"live-{os.getpid()}"}
    with running(tmp, cfg, env=env) as d:
        d.wait_state("ready")
        os.kill(d.sglang_pid(), signal.SIGKILL)
        d.wait_state("restarting")
        d.wait_state("ready")
        text = d.get("/metrics").text
    return text


def test_promtool_check_metrics_on_a_live_scrape(promtool: Path, live_scrape: str) -> None:
    r = subprocess.run(
        [str(promtool), "check", "metrics"],
        input=live_scrape,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # promtool prints lint problems without failing on some; there must be none.
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_live_scrape_has_every_contract_metric(live_scrape: str) -> None:
    names = series_from_exposition(live_scrape)
    for name in (
        "kimi_serve_state",
        "kimi_serve_ready",
        "kimi_serve_restarts_total",
        "kimi_serve_child_starts_total",
        "kimi_serve_probe_duration_seconds_bucket",
        "kimi_serve_probe_failures_total",
        "kimi_serve_last_load_duration_seconds",
        "kimi_serve_child_start_time_seconds",
        "kimi_serve_gpu_leftover_processes_killed_total",
        "kimi_serve_gpu_memory_release_seconds",
        "kimi_serve_profile_info",
        "kimi_serve_build_info",
        "kimi_serve_log_lines_total",
    ):
        assert name in names, f"{name} missing from a live scrape"
    assert 'kimi_serve_restarts_total{reason="exited"} 1.0' in live_scrape


def test_live_scrape_names_the_running_sglang_and_every_state(live_scrape: str) -> None:
    # The version the server itself reports in /server_info (the stand-in's), not `unknown`:
    # the configured module is not SGLang, so preflight could not read one.
    assert 'sglang_version="0.5.23-standin"' in live_scrape
    assert 'sglang_version="unknown"' not in live_scrape
    # Every state's series exists, `waiting` included, at 0 while ready.
    assert 'kimi_serve_state{state="waiting"} 0.0' in live_scrape


def test_live_scrape_has_the_quality_and_downtime_series(live_scrape: str) -> None:
    # The alerts read these from the first scrape: a degraded reason at 0, not absent, and the
    # downtime histogram before any restart has been measured.
    names = series_from_exposition(live_scrape)
    for reason in ("canary_mismatch", "spec_collapse", "slow_decode", "no_cuda_graph"):
        assert f'kimi_serve_quality_degraded{{reason="{reason}"}}' in live_scrape, reason
    for name in ("_bucket", "_sum", "_count"):
        assert f"kimi_serve_restart_downtime_seconds{name}" in names, name
    assert 'gpu="0"' in live_scrape and "UUID=" in live_scrape


def test_dashboard_and_rules_only_query_live_series(
    live_scrape: str, dashboard: dict[str, Any], rules: dict[str, Any]
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    # A gauge family the daemon declares (HELP/TYPE) is exported even while it has no sample
    # yet: the load phases appear once a load has completed.
    declared = {f.name for f in text_string_to_metric_families(live_scrape) if f.type == "gauge"}
    live = series_from_exposition(live_scrape) | declared
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    sglang = {n for _, e in dashboard_exprs(dashboard) for n in _names(e) if ":" in n}
    # A counter labelled by Xid has no series before its first event: no Xid can be exported
    # at 0 ahead of time (the alert's expression handles a series that is born at 1).
    born_with_first_event = {"kimi_serve_gpu_xid_events_total"}
    known = live | PROMETHEUS_SERIES | recorded | sglang | born_with_first_event
    problems = unknown_names(dashboard_exprs(dashboard) + rules_exprs(rules), known)
    assert not problems, "queried but not exported:\n" + "\n".join(problems)


def _names(expr: str) -> set[str]:
    return {n for n in metric_names(expr) if n.startswith("sglang:")}


def test_live_scrape_has_the_load_phases(live_scrape: str) -> None:
    names = series_from_exposition(live_scrape)
    assert "kimi_serve_load_phase_seconds" in names
    # The stand-in prints every marker, so every phase is there after a load, warmup too: it
    # ends at the earlier of SGLang's ready line and the start of the probe that passed.
    for phase in ("init", "weights", "kv_cache", "cuda_graph", "warmup", "probe"):
        assert f'kimi_serve_load_phase_seconds{{phase="{phase}"}}' in live_scrape, phase
