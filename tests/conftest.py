"""The test kit's own asserts (testkit/) report their values as a test's asserts do
(`register_assert_rewrite`).

How the suite is split between pytest-xdist workers (`scripts/test -n 2 --dist loadgroup`,
or pytest with the same options): every module runs whole on one worker, in file order, so
module- and session-scoped fixtures are set up once and tests that build on the one before
still do.

The modules that start real SGLang servers, boot systemd or install the package in a box, and
the two that time real SGLang's parser, are one group, `serial`, run one after another on one
worker: they are heavy (a real launch takes 20-60 s of both cores) and share the real-SGLang
environment, its canary model build and the box's host-wide checks. Every other module is a
group of its own, spread over the workers beside them, the largest (by tests) first; `serial`
goes before all of them, and its worker takes nothing else until it is nearly done.

The groups are given to xdist's scheduler here rather than as `xdist_group` marks: pytest-xdist
3.8 tags a marked test by rewriting `item._nodeid`, which pytest 9.2 no longer reads
(`Node.nodeid` is built from `Node._id`), so marks would group nothing. Without xdist, or with
another `--dist`, nothing here applies and the order is pytest's own.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.register_assert_rewrite("testkit")

SERIAL_GROUP = "serial"
SERIAL = (
    "tests/realsglang/",
    "tests/conformance/",
    "tests/systemd/",
    "tests/packaging/",
    # Real SGLang's parser, timed ("in seconds"): never beside a real server's launch.
    "tests/preflight/test_parser_real.py",
    "tests/preflight/test_run_exit.py",
)


def group_of(nodeid: str) -> str:
    """The group of a test: `serial` for the heavy modules, else its module's path."""
    module = nodeid.split("::", 1)[0]
    return SERIAL_GROUP if module.startswith(SERIAL) else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            # The serial group first: it is the longest, and while more than two of its tests
            # are pending its worker is given nothing else (LoadScopeScheduling._reschedule).
            if SERIAL_GROUP in self.workqueue:
                self.workqueue.move_to_end(SERIAL_GROUP, last=False)
            super()._assign_work_unit(node)

    return ModuleGroups(config, log)
