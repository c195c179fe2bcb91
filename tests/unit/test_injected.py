"""daemon.injected: the test-only internal error fires where its file says, once per file,
and only for a regular file of this user; without the variable it is never looked for."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.daemon import injected


def test_it_raises_where_the_file_says_and_once(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    fault.write_text("dispatch\n")
    injected.check("task", str(fault))  # elsewhere: nothing, the file stays
    assert fault.exists()
    with pytest.raises(injected.InjectedError, match="injected in the dispatch"):
        injected.check("dispatch", str(fault))
    assert not fault.exists()
    injected.check("dispatch", str(fault))  # gone: no second error


def test_only_a_regular_file_counts(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("task")
    link = tmp_path / "link"
    link.symlink_to(target)
    injected.check("task", str(link))
    os.mkfifo(tmp_path / "fifo")
    injected.check("task", str(tmp_path / "fifo"))  # never opened: no wait on a FIFO
    assert target.exists() and link.is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_does_not_count(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    fault.write_text("task")
    os.chown(fault, 65534, 65534)
    injected.check("task", str(fault))
    assert fault.exists()


def test_off_without_the_variable() -> None:
    assert injected.ENV not in os.environ
    assert injected._PATH is None
    injected.check("task")
