"""Prometheus rules: promtool-clean, unit-tested, and every alert actionable.

The behaviour of each alert (when it fires, when it must not) lives in
kimi-serve-rules.test.yml and runs through `promtool test rules`; this module
runs it and checks what promtool does not: that every alert carries the
annotations an on-call engineer needs, that its runbook link lands on a real
heading of docs/runbook.md, and that the unit tests cover every alert both ways.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.observability import (
    RULES_FILE,
    RULES_TEST_FILES,
    RUNBOOK_DEFAULT_URL,
    RUNBOOK_FILE,
    RUNBOOK_INSTALLED,
    RUNBOOK_SITE_LABEL,
    RUNBOOK_URL,
    github_slug,
    run_promtool,
    runbook_anchors,
    unknown_runbook_anchors,
)
from testkit.paths import REPO_ROOT

SEVERITIES = {"critical", "warning", "info"}


def test_promtool_check_rules(promtool: Path) -> None:
    done = run_promtool(promtool, "check", "rules", str(RULES_FILE))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_promtool_test_rules(promtool: Path) -> None:
    assert len(RULES_TEST_FILES) >= 2
    done = run_promtool(promtool, "test", "rules", *map(str, RULES_TEST_FILES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_unit_tests_fix_the_group_order() -> None:
    # Without group_eval_order promtool evaluates the groups in Go's random map
    # order; an alert reading a recording rule then sees no record on the runs
    # where the alerts group happens to go first (at a 1h interval the previous
    # evaluation's record is outside the 5m lookback). Records first, always.
    groups = [g["name"] for g in yaml.safe_load(RULES_FILE.read_text())["groups"]]
    records = [
        g["name"]
        for g in yaml.safe_load(RULES_FILE.read_text())["groups"]
        if any("record" in r for r in g["rules"])
    ]
    for path in RULES_TEST_FILES:
        order = yaml.safe_load(path.read_text()).get("group_eval_order")
        assert order is not None, f"{path.name}: no group_eval_order"
        assert sorted(order) == sorted(groups), f"{path.name}: {order} != {groups}"
        first_alerts = min(i for i, name in enumerate(order) if name not in records)
        assert all(order.index(r) < first_alerts for r in records), order


def test_alert_names_are_unique(alert_rules: list[dict[str, Any]]) -> None:
    dupes = [n for n, c in Counter(r["alert"] for r in alert_rules).items() if c > 1]
    assert not dupes


def test_alerts_exist(alert_rules: list[dict[str, Any]]) -> None:
    # Guards the parametrised tests below against silently running on nothing.
    assert len(alert_rules) >= 19


def test_every_alert_is_annotated(alert_rules: list[dict[str, Any]]) -> None:
    problems = []
    for rule in alert_rules:
        name = rule["alert"]
        labels = rule.get("labels", {})
        notes = rule.get("annotations", {})
        if labels.get("severity") not in SEVERITIES:
            problems.append(f"{name}: severity {labels.get('severity')!r} not in {SEVERITIES}")
        for key in ("summary", "description", "runbook_url"):
            if not str(notes.get(key, "")).strip():
                problems.append(f"{name}: annotation {key!r} missing or empty")
        if "$labels." not in notes.get("description", ""):
            problems.append(f"{name}: description quotes no label ($labels.<name>)")
        link = RUNBOOK_URL.fullmatch(str(notes.get("runbook_url", "")))
        if link is None:
            problems.append(f"{name}: runbook_url is not of the form {RUNBOOK_URL.pattern}")
        elif link["default"] != RUNBOOK_DEFAULT_URL:
            problems.append(f"{name}: runbook_url defaults to {link['default']}")
    assert not problems, "\n".join(problems)


def test_the_default_runbook_link_is_where_the_package_installs_it() -> None:
    # dh_installdocs puts the files listed in debian/<package>.docs in /usr/share/doc/<package>/.
    docs = (REPO_ROOT / "packaging" / "debian" / "kimi-serve.docs").read_text().split()
    assert "docs/runbook.md" in docs
    assert RUNBOOK_INSTALLED == "/usr/share/doc/kimi-serve/runbook.md"
    # ... and dh_compress would make it runbook.md.gz (over 4 KiB), breaking every link.
    rules = (REPO_ROOT / "packaging" / "debian" / "rules").read_text()
    assert re.search(r"^\tdh_compress\b.*-X\s*runbook\.md\b", rules, flags=re.M), rules


def test_promtool_renders_every_link_to_its_anchor() -> None:
    """What promtool really rendered (the unit tests' expected annotations): the installed
    runbook, or the page the external label names, with the alert's own anchor."""
    anchors = runbook_anchors(RUNBOOK_FILE.read_text())
    seen: set[str] = set()
    problems = []
    for path in RULES_TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            base = case.get("external_labels", {}).get(RUNBOOK_SITE_LABEL, RUNBOOK_DEFAULT_URL)
            for check in case.get("alert_rule_test", []):
                for alert in check.get("exp_alerts") or []:
                    url = alert.get("exp_annotations", {}).get("runbook_url")
                    if url is None:
                        continue
                    seen.add(base)
                    page, _, anchor = url.partition("#")
                    if page != base or anchor not in anchors:
                        problems.append(f"{path.name} {check['alertname']}: {url}")
    assert not problems, "\n".join(problems)
    assert RUNBOOK_DEFAULT_URL in seen and len(seen) >= 2, seen


def test_restart_alerts_name_the_reason(alert_rules: list[dict[str, Any]]) -> None:
    restarted = next(r for r in alert_rules if r["alert"] == "KimiServeRestarted")
    assert "$labels.reason" in restarted["annotations"]["description"]


# --- runbook anchors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("KimiServeCrashLooping", "kimiservecrashlooping"),
        (
            "Known incident: healthy but dead on first decode",
            "known-incident-healthy-but-dead-on-first-decode",
        ),
        ("The `reason` label (v2.0)", "the-reason-label-v20"),
        ("snake_case stays", "snake_case-stays"),
    ],
)
def test_github_slug(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_runbook_anchors_number_repeats() -> None:
    assert runbook_anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_every_runbook_url_lands_on_a_heading(alert_rules: list[dict[str, Any]]) -> None:
    missing = unknown_runbook_anchors(alert_rules, RUNBOOK_FILE.read_text())
    assert not missing, f"runbook_url anchors with no heading in {RUNBOOK_FILE}: {missing}"


def test_a_missing_runbook_heading_is_reported(alert_rules: list[dict[str, Any]]) -> None:
    # The check above must be able to fail: a runbook without the canary's section.
    text = RUNBOOK_FILE.read_text().replace("## KimiServeCanaryMismatch\n", "## Canary\n")
    assert unknown_runbook_anchors(alert_rules, text) == [
        "KimiServeCanaryMismatch: #kimiservecanarymismatch"
    ]


def test_every_alert_has_a_runbook_section_named_after_it(
    alert_rules: list[dict[str, Any]],
) -> None:
    headings = set(re.findall(r"^## (\S+)\s*$", RUNBOOK_FILE.read_text(), flags=re.M))
    missing = sorted({r["alert"] for r in alert_rules} - headings)
    assert not missing, f"no '## <alert>' section in {RUNBOOK_FILE}: {missing}"


def test_runbook_internal_links_resolve() -> None:
    text = RUNBOOK_FILE.read_text()
    anchors = runbook_anchors(text)
    broken = sorted(set(re.findall(r"\]\(#([^)]+)\)", text)) - anchors)
    assert not broken, f"links to missing anchors in {RUNBOOK_FILE}: {broken}"


def test_runbook_covers_every_restart_reason() -> None:
    text = RUNBOOK_FILE.read_text()
    reasons = [
        "exited",
        "load_timeout",
        "readiness_failed",
        "liveness_failed",
        "fatal_log",
        "manual",
        "reload",
        "gpu_fault",
        "canary_mismatch",
    ]
    assert [r for r in reasons if f"`{r}`" not in text] == []


# --- unit-test coverage ------------------------------------------------------------


def test_every_alert_is_unit_tested_firing_and_silent(
    alert_rules: list[dict[str, Any]],
) -> None:
    cases = [case for f in RULES_TEST_FILES for case in yaml.safe_load(f.read_text())["tests"]]
    fires: set[str] = set()
    silent: set[str] = set()
    for case in cases:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {r["alert"] for r in alert_rules}
    assert not names - fires, f"alerts never tested firing: {sorted(names - fires)}"
    assert not names - silent, f"alerts never tested silent: {sorted(names - silent)}"
    unknown = (fires | silent) - names
    assert not unknown, f"tests for alerts that do not exist: {sorted(unknown)}"


def test_every_recording_rule_is_unit_tested(rules: dict[str, Any]) -> None:
    cases = [case for f in RULES_TEST_FILES for case in yaml.safe_load(f.read_text())["tests"]]
    tested = " ".join(check["expr"] for case in cases for check in case.get("promql_expr_test", []))
    records = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    assert [r for r in records if r not in tested] == []


def test_restart_alerts_start_with_the_incident() -> None:
    # On-call's first step after any restart is the incident the daemon wrote for it.
    text = RUNBOOK_FILE.read_text()
    for alert in ("KimiServeRestarted", "KimiServeCrashLooping", "KimiServeFailed"):
        section = text.split(f"## {alert}\n", 1)[1]
        look = section.split("**Look:**\n", 1)[1].lstrip()
        assert look.startswith("- `kimi-serve incidents show last`"), alert
