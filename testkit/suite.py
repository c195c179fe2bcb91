"""The suite's own machinery, used by tests/conftest.py: which tests the quick tier leaves out
(the markers `real_sglang` and `daemon`), and the seconds spent per directory of tests/.
docs/testing.md has the tiers."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

# The session fixtures that build or reach the real SGLang environment (tools/sglang-env):
# tests/realsglang and tests/conformance (`sgl`, `canary_sgl`), SGLang's own parser
# (`sglang_python`, testkit/preflight.py).
REAL_SGLANG_FIXTURES = frozenset({"sgl", "canary_sgl", "sglang_python"})
# The directories whose every test starts kimi-serve (and the stand-in) and follows a scenario
# through seconds of its timers.
DAEMON_DIRS = frozenset({"integration", "reliability"})


def directory_of(nodeid: str) -> str:
    """The directory under tests/ a test belongs to: `tests/unit/test_x.py::t` -> `unit`; a test
    file directly in tests/ -> `.`."""
    path = nodeid.split("::", 1)[0]
    parts = Path(path).parts
    if parts and parts[0] == "tests":
        parts = parts[1:]
    return parts[0] if len(parts) > 1 else "."


def mark(items: Iterable[pytest.Item]) -> None:
    """`real_sglang` on the tests that ask for one of REAL_SGLANG_FIXTURES (directly or through
    another fixture), `daemon` on those of DAEMON_DIRS."""
    for item in items:
        if REAL_SGLANG_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_sglang)
        if directory_of(item.nodeid) in DAEMON_DIRS:
            item.add_marker(pytest.mark.daemon)


def per_directory_table(seconds: dict[str, float], counts: dict[str, int]) -> list[str]:
    """The lines of the per-directory summary, slowest first, with the total."""
    total = sum(seconds.values())
    lines = [f"{'directory':<16} {'tests':>6} {'seconds':>9} {'share':>6}"]
    for where, s in sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0])):
        share = 100.0 * s / total if total > 0 else 0.0
        lines.append(f"{where:<16} {counts.get(where, 0):>6} {s:>9.1f} {share:>5.1f}%")
    lines.append(f"{'total':<16} {sum(counts.values()):>6} {total:>9.1f} {100.0:>5.1f}%")
    return lines
