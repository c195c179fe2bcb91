"""supervisor.incidents: one directory per restart, atomic, private, bounded; a real small
filesystem for the full-disk cases."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.incidents import (
    INCIDENT_JSON,
    LOG_TAIL,
    STACKS,
    Incident,
    IncidentStore,
    newest_crash_dump,
)
from testkit.incidents import TRACEBACK, Clock, cfg, incident


def test_one_directory_per_incident_private_and_complete(tmp_path: Path) -> None:
    store = IncidentStore(cfg(tmp_path / "incidents"), clock=lambda: 1_795_000_000.0)
    w = store.write(incident())
    assert w.error is None and w.path is not None
    assert w.path.name == "20261118T110640Z-liveness_failed-launch3"
    # Private: the directory and every file the service user's alone, whatever the umask.
    assert stat.S_IMODE(w.path.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "incidents").stat().st_mode) == 0o700
    for f in w.path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        assert f.stat().st_uid == os.geteuid()
    assert sorted(p.name for p in w.path.iterdir()) == [INCIDENT_JSON, LOG_TAIL, STACKS]
    doc = json.loads((w.path / INCIDENT_JSON).read_text())
    assert doc["reason"] == "liveness_failed" and doc["launch"] == 3
    assert doc["exception"] == TRACEBACK[-1]
    assert doc["signal"] == 9 and doc["exit_code"] is None
    assert doc["profile"] == "primary"
    assert doc["config"] == {"path": "/etc/kimi-serve/kimi-serve.yaml", "digest": "sha256:abc"}
    assert doc["server_info"]["speculative_algorithm"] == "EAGLE3"
    assert doc["gpus"][0]["uuid"] == "GPU-1"
    assert doc["timings"]["ready_at"] == 1_794_999_600.0
    assert doc["stacks"]["taken"] is True and doc["stacks"]["seconds"] == 0.41
    assert doc["files"] == [INCIDENT_JSON, LOG_TAIL, STACKS] and doc["skipped"] == {}
    assert (w.path / LOG_TAIL).read_text().splitlines() == TRACEBACK
    assert "cuModuleLoadData" in (w.path / STACKS).read_text()


def test_no_stacks_says_why(tmp_path: Path) -> None:
    store = IncidentStore(cfg(tmp_path))
    inc = incident(reason="exited")
    inc = Incident(**{**inc.__dict__, "capture": None, "no_stacks_reason": "process already dead"})
    w = store.write(inc)
    assert w.path is not None
    doc = json.loads((w.path / INCIDENT_JSON).read_text())
    assert doc["stacks"] == {"taken": False, "reason": "process already dead"}
    assert (w.path / STACKS).read_text() == "# no stacks: process already dead\n"


def test_same_second_same_launch_gets_a_suffix(tmp_path: Path) -> None:
    store = IncidentStore(cfg(tmp_path), clock=lambda: 1_795_000_000.0)
    a, b = store.write(incident()), store.write(incident())
    assert a.path is not None and b.path is not None
    assert b.path.name == a.path.name + "-2"
    assert [p.name for p in store.entries()] == [b.path.name, a.path.name]


def test_retention_keeps_the_newest(tmp_path: Path) -> None:
    store = IncidentStore(cfg(tmp_path, keep=3), clock=Clock())
    names = [store.write(incident(launch=n)).path.name for n in range(1, 6)]  # type: ignore[union-attr]
    assert [p.name for p in store.entries()] == names[::-1][:3]


def test_total_size_is_bounded_and_the_new_one_survives(tmp_path: Path) -> None:
    big = "x" * 100_000 + "\n"
    store = IncidentStore(cfg(tmp_path, max_bytes=350_000), clock=Clock())
    written = [store.write(incident(launch=n, stacks=big)) for n in range(1, 6)]
    kept = store.entries()
    assert [p.name for p in kept] == [w.path.name for w in written[::-1][:3]]  # type: ignore[union-attr]
    total = sum(f.stat().st_size for p in kept for f in p.iterdir())
    assert total <= 350_000
    assert written[-1].removed == (written[1].path.name,)  # type: ignore[union-attr]


def test_a_file_larger_than_half_the_bound_is_skipped(tmp_path: Path) -> None:
    store = IncidentStore(cfg(tmp_path, max_bytes=100_000))
    w = store.write(incident(stacks="y" * 60_000))
    assert w.path is not None and STACKS in w.skipped
    doc = json.loads((w.path / INCIDENT_JSON).read_text())
    assert STACKS not in doc["files"] and "max_bytes" in doc["skipped"][STACKS]
    assert not (w.path / STACKS).exists()


def test_under_the_free_space_floor_only_the_small_file_is_written(tmp_path: Path) -> None:
    # The floor is checked against the filesystem's real free space (statvfs), here faked
    # at 3 MiB so that a 1 MiB stack dump would cross a 2.5 MiB floor.
    store = IncidentStore(
        cfg(tmp_path, min_free_bytes=int(2.5 * 2**20)), free_bytes=lambda _p: 3 * 2**20
    )
    w = store.write(incident(stacks="z" * 2**20))
    assert w.path is not None
    doc = json.loads((w.path / INCIDENT_JSON).read_text())
    assert "min_free_bytes" in doc["skipped"][STACKS]
    assert LOG_TAIL in doc["files"]  # small enough to fit above the floor
    assert doc["stacks"]["taken"] is True  # taken, just not kept: the summary still says where


def test_stale_temporaries_are_swept_and_never_listed(tmp_path: Path) -> None:
    store = IncidentStore(cfg(tmp_path))
    stale = tmp_path / ".tmp-20261118T083320Z-fatal_log-launch1-999-abcd"
    stale.mkdir()
    (stale / LOG_TAIL).write_text("half")
    assert store.entries() == []
    w = store.write(incident())
    assert not stale.exists()
    assert [p.name for p in store.entries()] == [w.path.name]  # type: ignore[union-attr]


# --------------------------------------------------------------------------- crashes mid-write

WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from supervisor import incidents
    from testkit.incidents import cfg, incident

    real = incidents._write_file
    def slow(path, data):
        real(path, data)
        if path.name == sys.argv[2]:
            print("wrote", path.name, flush=True)
            time.sleep(60)  # killed here
    incidents._write_file = slow
    incidents.IncidentStore(cfg(Path(sys.argv[1]))).write(incident(stacks="s" * 100000))
    """
)


@pytest.mark.parametrize("killed_after", [LOG_TAIL, STACKS, INCIDENT_JSON])
def test_a_write_killed_midway_leaves_nothing_that_looks_complete(
    tmp_path: Path, killed_after: str
) -> None:
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), killed_after],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["wrote", killed_after]
    finally:
        proc.kill()
        proc.wait()
    store = IncidentStore(cfg(tmp_path))
    assert store.entries() == []  # nothing visible: the list, `show`, retention all agree
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp-")
    w = store.write(incident())  # the next write sweeps the leftover
    assert [p.name for p in tmp_path.iterdir()] == [w.path.name]  # type: ignore[union-attr]


# --------------------------------------------------------------------------- a real full disk


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, mounted for the test and unmounted after."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def fill(path: Path, leave: int) -> None:
    """Fill the filesystem holding `path` until at most `leave` bytes are free."""
    with open(path / "filler", "wb") as f:
        chunk = b"\0" * 65536
        with contextlib.suppress(OSError):
            while True:
                st = os.statvfs(path)
                free = st.f_bavail * st.f_frsize
                if free <= leave:
                    break
                f.write(chunk[: max(1, min(len(chunk), free - leave))])
                f.flush()


def test_full_disk_the_floor_keeps_stacks_off_a_real_small_filesystem(small_fs: Path) -> None:
    store = IncidentStore(cfg(small_fs / "incidents", min_free_bytes=2**20))
    w = store.write(incident(stacks="q" * 1_500_000))  # 1.5 MiB of 2: would cross the floor
    assert w.path is not None and w.error is None
    doc = json.loads((w.path / INCIDENT_JSON).read_text())
    assert STACKS in doc["skipped"] and "min_free_bytes" in doc["skipped"][STACKS]
    st = os.statvfs(small_fs)
    assert st.f_bavail * st.f_frsize >= 2**20


def test_full_disk_a_file_that_does_not_fit_is_not_attempted(small_fs: Path) -> None:
    store = IncidentStore(cfg(small_fs / "incidents"))  # no floor at all
    store.ensure_dir()
    fill(small_fs, leave=400_000)
    w = store.write(incident(stacks="q" * 600_000))
    assert w.path is not None and STACKS in w.skipped
    assert (w.path / LOG_TAIL).is_file()


def test_full_disk_enospc_midway_leaves_nothing(small_fs: Path) -> None:
    # The disk fills between the free-space check and the write (another writer): the write
    # fails with ENOSPC half-way, and the half-written temporary goes.
    store = IncidentStore(cfg(small_fs / "incidents"), free_bytes=lambda _p: 10**12)
    store.ensure_dir()
    fill(small_fs, leave=400_000)
    w = store.write(incident(stacks="q" * 600_000))
    assert w.path is None and w.error is not None and "No space left" in w.error
    assert list((small_fs / "incidents").iterdir()) == []  # the temporary went too


def test_full_disk_nothing_at_all_is_written_when_nothing_fits(small_fs: Path) -> None:
    store = IncidentStore(cfg(small_fs / "incidents", min_free_bytes=2**20))
    store.ensure_dir()
    fill(small_fs, leave=8192)
    w = store.write(incident())
    assert w.path is None and w.error is not None and "nothing written" in w.error
    assert list((small_fs / "incidents").iterdir()) == []


# --------------------------------------------------------------------------- crash dumps


def test_crash_dump_pointer_names_the_newest_file_and_warns(tmp_path: Path) -> None:
    host = tmp_path / "dumps" / "gpu-a"
    host.mkdir(parents=True)
    old, new = host / "crash_dump_2026-11-30_01-00-00.pkl", host / "crash_dump_2026-12-01.pkl"
    old.write_bytes(b"old")
    new.write_bytes(b"newer")
    os.utime(old, (1_000, 1_000))
    os.utime(new, (2_000, 2_000))
    doc = newest_crash_dump(str(tmp_path / "dumps"), since=1_500)
    assert doc is not None
    assert doc["file"] == str(new) and doc["size_bytes"] == 5 and doc["from_this_launch"]
    assert "prompts" in doc["note"]
    assert newest_crash_dump(str(tmp_path / "none"))["file"] is None  # type: ignore[index]
    assert newest_crash_dump(None) is None
