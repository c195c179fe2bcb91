"""The harness's own checks, without booting anything: they must be able to fail."""

from __future__ import annotations

import itertools
import os
import shutil
import time
from pathlib import Path

import pytest

from testkit.box import (
    TMP_SETTLE_SECONDS,
    Box,
    BoxUnavailable,
    HostSnapshot,
    exec_line,
    unit_file_text,
    wait_for,
)

NOW = 1_000_000.0
OLD = NOW - TMP_SETTLE_SECONDS - 1
YOUNG = NOW - 1


def snapshot(tmp: dict[str, float], dev: dict[str, float]) -> HostSnapshot:
    return HostSnapshot(taken_at=NOW, tmp=tmp, dev=dev)


def test_nothing_changed_is_no_change() -> None:
    before = snapshot({"a": OLD}, {"null": OLD})
    assert snapshot({"a": OLD}, {"null": OLD}).changes_since(before) == []


def test_an_old_tmp_entry_vanishing_is_a_change() -> None:
    before = snapshot({"hsperfdata_root": OLD, "fresh": YOUNG}, {})
    after = snapshot({"fresh": YOUNG}, {})
    assert after.changes_since(before) == ["/tmp/hsperfdata_root vanished"]


def test_young_tmp_entries_come_and_go_with_other_programs() -> None:
    before = snapshot({"pip-build-1": YOUNG}, {})
    after = snapshot({"pip-build-2": YOUNG}, {})
    assert after.changes_since(before) == []


def test_a_private_tmp_of_a_unit_appearing_is_a_change() -> None:
    before = snapshot({}, {})
    after = snapshot({"systemd-private-0123-demo.service-abc": YOUNG}, {})
    assert after.changes_since(before) == ["/tmp/systemd-private-0123-demo.service-abc appeared"]


def test_any_dev_entry_appearing_or_vanishing_is_a_change() -> None:
    before = snapshot({}, {"null": OLD, "kmsg": OLD})
    after = snapshot({}, {"null": OLD, "log": YOUNG})
    assert after.changes_since(before) == ["/dev/log appeared", "/dev/kmsg vanished"]


def test_take_lists_top_level_entries(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    (tmp_path / "dev").mkdir()
    (tmp_path / "tmp" / "file").write_text("x")
    (tmp_path / "tmp" / "dir").mkdir()
    (tmp_path / "tmp" / "dir" / "nested").write_text("x")
    (tmp_path / "dev" / "link").symlink_to("/nonexistent")
    taken = HostSnapshot.take(tmp_path / "tmp", tmp_path / "dev")
    assert sorted(taken.tmp) == ["dir", "file"]
    assert sorted(taken.dev) == ["link"]
    assert taken.taken_at == pytest.approx(time.time(), abs=60)


def test_wait_for_returns_the_first_truthy_value() -> None:
    values = iter([0, None, "", "done"])
    assert wait_for(lambda: next(values), timeout=5, interval=0) == "done"


def test_wait_for_names_what_it_waited_for() -> None:
    counter = itertools.count()
    with pytest.raises(TimeoutError, match=r"the answer not true after 0.05s; last value: 0"):
        wait_for(lambda: next(counter) * 0, timeout=0.05, interval=0.01, what="the answer")


def test_exec_line_quotes_and_refuses_unit_file_expansions() -> None:
    assert exec_line("/usr/bin/python3", "-c", "print('hi there')") == (
        "/usr/bin/python3 -c 'print('\"'\"'hi there'\"'\"')'"
    )
    with pytest.raises(ValueError, match="meanings of their own"):
        exec_line("/bin/echo", "$HOME")
    with pytest.raises(ValueError, match="meanings of their own"):
        exec_line("/bin/echo", "100%")


def test_unit_file_text_dedents_test_strings() -> None:
    text = unit_file_text(
        """
        [Service]
        ExecStart=/bin/true
        """
    )
    assert text == "[Service]\nExecStart=/bin/true\n"


def test_a_box_needs_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(BoxUnavailable, match="needs root"):
        Box(tmp_path / "box").start()
    assert not (tmp_path / "box").exists()


def test_a_box_needs_unshare(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "unshare" else f"/bin/{tool}")
    with pytest.raises(BoxUnavailable, match="unshare is not installed"):
        Box(tmp_path / "box").start()
