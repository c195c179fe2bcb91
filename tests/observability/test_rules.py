"""Prometheus rules: promtool-clean, unit-tested, and every alert actionable.

The behaviour of each alert (when it fires, when it must not) lives in
kimi-serve-rules.test.yml and runs through `promtool test rules`; this module
runs it and checks what promtool does not: that every alert carries the
annotations an on-call engineer needs, that its runbook link lands on a real
heading of docs/runbook.md, and that the unit tests cover every alert both ways.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import RULES_FILE, RULES_TEST_FILES, RUNBOOK_FILE, run_promtool

RUNBOOK_URL_PREFIX = "https://github.com/kimi-serve/kimi-serve/blob/main/docs/runbook.md#"
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
    assert len(alert_rules) >= 11


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
        if not str(notes.get("runbook_url", "")).startswith(RUNBOOK_URL_PREFIX):
            problems.append(f"{name}: runbook_url does not start with {RUNBOOK_URL_PREFIX}")
    assert not problems, "\n".join(problems)


def test_restart_alerts_name_the_reason(alert_rules: list[dict[str, Any]]) -> None:
    restarted = next(r for r in alert_rules if r["alert"] == "KimiServeRestarted")
    assert "$labels.reason" in restarted["annotations"]["description"]


# --- runbook anchors -------------------------------------------------------------


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
    anchors = runbook_anchors(RUNBOOK_FILE.read_text())
    missing = [
        f"{r['alert']}: #{r['annotations']['runbook_url'].split('#', 1)[1]}"
        for r in alert_rules
        if r["annotations"]["runbook_url"].split("#", 1)[1] not in anchors
    ]
    assert not missing, f"runbook_url anchors with no heading in {RUNBOOK_FILE}: {missing}"


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
