"""The whole suite's hooks.

- The test kit's own asserts (testkit/: the machine driver, the stand-in launcher, the rigs)
  report their values as a test's asserts do.
- `real_sglang` and `daemon` are set on the tests they describe (testkit/suite.py);
  `scripts/test --quick` leaves both out, with `systemd` and `slow` (docs/testing.md).
- The summary ends with the seconds spent per directory of tests/ (setup, call and teardown
  added up), the figure docs/testing.md keeps before and after a change to the suite.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from testkit import suite

pytest.register_assert_rewrite("testkit")
pytest_plugins = ["pytester"]  # tests/unit/test_suite_hooks.py runs testkit.suite in a sandbox

_seconds: defaultdict[str, float] = defaultdict(float)
_counted: defaultdict[str, set[str]] = defaultdict(set)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    suite.mark(items)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    where = suite.directory_of(report.nodeid)
    _seconds[where] += report.duration
    _counted[where].add(report.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds:
        return
    counts = {where: len(ids) for where, ids in _counted.items()}
    terminalreporter.write_sep("=", "seconds per directory of tests/ (setup + call + teardown)")
    for line in suite.per_directory_table(dict(_seconds), counts):
        terminalreporter.write_line(line)
