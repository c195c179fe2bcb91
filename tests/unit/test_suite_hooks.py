"""The suite's own machinery (testkit/suite.py): the per-directory summary, the markers the
quick tier leaves out, and the port range each pytest-xdist worker hands out."""

from __future__ import annotations

import socket

import pytest

from testkit import suite, wait


def test_a_test_belongs_to_its_directory_under_tests() -> None:
    assert suite.directory_of("tests/unit/test_x.py::test_y[a/b]") == "unit"
    assert suite.directory_of("tests/realsglang/sub/test_x.py::T::t") == "realsglang"
    assert suite.directory_of("tests/test_top.py::t") == "."


def test_the_table_is_slowest_first_with_shares_and_a_total() -> None:
    lines = suite.per_directory_table({"unit": 10.0, "integration": 30.0}, {"unit": 5, "x": 0})
    assert lines[1].split() == ["integration", "0", "30.0", "75.0%"]
    assert lines[2].split() == ["unit", "5", "10.0", "25.0%"]
    assert lines[-1].split() == ["total", "5", "40.0", "100.0%"]


def test_this_test_is_marked_neither_real_sglang_nor_daemon(request: pytest.FixtureRequest) -> None:
    names = {m.name for m in request.node.iter_markers()}
    assert "real_sglang" not in names and "daemon" not in names


def test_a_test_asking_for_real_sglang_is_marked(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "import pytest\n"
        "from testkit import suite\n"
        "def pytest_collection_modifyitems(items):\n"
        "    suite.mark(items)\n"
        "@pytest.fixture(scope='session')\n"
        "def sgl():\n"
        "    return 'env'\n"
        "@pytest.fixture\n"
        "def server(sgl):\n"
        "    return sgl\n"
    )
    pytester.makepyfile("def test_through_another_fixture(server): pass\ndef test_plain(): pass\n")
    marked = pytester.runpytest("-m", "real_sglang", "-p", "no:cacheprovider")
    marked.assert_outcomes(passed=1, deselected=1)
    unmarked = pytester.runpytest("-m", "not real_sglang", "-p", "no:cacheprovider")
    unmarked.assert_outcomes(passed=1, deselected=1)


def test_each_worker_hands_out_ports_from_its_own_range(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, set[int]] = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        seen[worker] = {wait.free_port() for _ in range(20)}
    lo0 = wait.PORT_BASE
    lo1 = wait.PORT_BASE + wait.PORTS_PER_WORKER
    assert all(lo0 <= p < lo1 for p in seen["gw0"]), seen["gw0"]
    assert all(lo1 <= p < lo1 + wait.PORTS_PER_WORKER for p in seen["gw1"]), seen["gw1"]
    assert len(seen["gw0"]) == 20  # one after the other, never the same port twice in a row


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    first = wait.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", first + 1))
        held.listen()
        got = {wait.free_port() for _ in range(3)}
    assert first + 1 not in got
