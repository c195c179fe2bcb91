"""The prewarm's memory bound: the host's MemAvailable and the daemon's memory cgroup's limit.

Laid-out /proc and cgroup trees for each hierarchy and container shape, then a real memory
cgroup with a limit (root, a writable memory controller) with a real prewarm plan in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.warm import memory, prewarm

MIB = 1 << 20
GIB = 1 << 30


def _proc(tmp: Path, cgroup: str, mounts: list[str], avail: int = 20 * GIB) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       {32 * GIB // 1024} kB\nMemFree: 1 kB\n"
        f"MemAvailable:   {avail // 1024} kB\n"
    )
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(
        "22 1 8:1 / / rw,relatime - ext4 /dev/vda rw\n"
        + "".join(_mountinfo_line(i, m) + "\n" for i, m in enumerate(mounts))
    )
    return proc


def _mountinfo_line(i: int, m: str) -> str:
    root, point, fstype, options = m.split()
    return f"{30 + i} 23 0:{40 + i} {root} {point} rw,relatime - {fstype} {fstype} {options}"


def _v2(d: Path, limit: str, current: int, inactive_file: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.max").write_text(limit + "\n")
    (d / "memory.current").write_text(f"{current}\n")
    (d / "memory.stat").write_text(f"anon 1\nfile 2\ninactive_file {inactive_file}\n")


def _v1(d: Path, limit: int, usage: int, inactive_file: int, hierarchical: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (d / "memory.stat").write_text(
        f"cache 1\nhierarchical_memory_limit {hierarchical}\n"
        f"inactive_file 5\ntotal_inactive_file {inactive_file}\n"
    )


UNLIMITED_V1 = 9223372036854771712


def test_no_cgroup_limit_leaves_the_host_bound(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    _v2(cg / "system.slice" / "kimi-serve.service", "max", 5 * GIB, GIB)
    _v2(cg / "system.slice", "max", 6 * GIB, GIB)
    proc = _proc(tmp_path, "0::/system.slice/kimi-serve.service\n", [f"/ {cg} cgroup2 rw"])
    assert memory.bound(proc) == memory.Bound(20 * GIB, 32 * GIB, "MemAvailable")


def test_a_unit_limit_bounds_by_limit_minus_working_set(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    unit = cg / "system.slice" / "kimi-serve.service"
    # MemoryMax=8G, 5 GiB charged of which 1 GiB inactive file: 4 GiB may still be filled.
    _v2(unit, str(8 * GIB), 5 * GIB, GIB)
    _v2(cg / "system.slice", "max", 9 * GIB, GIB)
    proc = _proc(tmp_path, "0::/system.slice/kimi-serve.service\n", [f"/ {cg} cgroup2 rw"])
    assert memory.bound(proc) == memory.Bound(4 * GIB, 8 * GIB, str(unit))


def test_the_smallest_of_every_limit_above_applies(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    unit = cg / "kubepods" / "pod1" / "ctr"
    _v2(unit, str(30 * GIB), 2 * GIB, 0)  # a generous container limit ...
    _v2(cg / "kubepods" / "pod1", str(6 * GIB), 5 * GIB, 2 * GIB)  # ... in a tight pod
    _v2(cg / "kubepods", "max", 5 * GIB, 0)
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n", [f"/ {cg} cgroup2 rw"])
    got = memory.bound(proc)
    assert got == memory.Bound(3 * GIB, 6 * GIB, str(cg / "kubepods" / "pod1"))
    # The default headroom follows the limit, not the host's 32 GiB.
    assert prewarm.default_headroom(got.total) == 2 * GIB


def test_a_full_cgroup_leaves_nothing_to_read(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    _v2(cg / "svc", str(4 * GIB), 7 * GIB, GIB)  # over its limit by what it cannot reclaim
    proc = _proc(tmp_path, "0::/svc\n", [f"/ {cg} cgroup2 rw"])
    assert memory.bound(proc).available == 0


def test_cgroup_v1_reads_the_hierarchical_limit(tmp_path: Path) -> None:
    mem = tmp_path / "memory"
    d = mem / "docker" / "abc"
    _v1(d, UNLIMITED_V1, 3 * GIB, 512 * MIB, hierarchical=4 * GIB)
    proc = _proc(
        tmp_path,
        "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/docker/abc\n",
        [f"/ {mem} cgroup rw,memory", f"/ {tmp_path / 'unified'} cgroup2 rw"],
    )
    assert memory.bound(proc) == memory.Bound(GIB + 512 * MIB, 4 * GIB, str(d))


def test_a_container_without_its_own_cgroup_namespace_reads_its_mount(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path; the container's mount is its own cgroup.
    mem = tmp_path / "memory"
    _v1(mem, 2 * GIB, GIB, 0, hierarchical=2 * GIB)
    proc = _proc(tmp_path, "4:memory:/docker/0123abcd\n", [f"/ {mem} cgroup rw,memory"])
    assert memory.bound(proc) == memory.Bound(GIB, 2 * GIB, str(mem))


def test_a_mount_of_a_subtree_is_read_relative_to_its_root(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    _v2(cg / "ctr", str(GIB), 256 * MIB, 0)
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n", [f"/kubepods/pod1 {cg} cgroup2 rw"])
    assert memory.bound(proc) == memory.Bound(768 * MIB, GIB, str(cg / "ctr"))


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("memory.max: garbage", None),
        ("memory.current: missing", None),
        ("cgroup: garbage", None),
        # No inactive-file figure: the whole charge counts as working set (the cautious side).
        ("memory.stat: missing", 3 * GIB),
        ("memory.stat: garbage", 3 * GIB),
    ],
)
def test_unreadable_or_malformed_cgroup_files(
    tmp_path: Path, damage: str, expected: int | None
) -> None:
    cg = tmp_path / "cg"
    _v2(cg / "svc", str(4 * GIB), GIB, 512 * MIB)
    proc = _proc(tmp_path, "0::/svc\n", [f"/ {cg} cgroup2 rw"])
    name, _, how = damage.partition(": ")
    target = proc / "self" / "cgroup" if name == "cgroup" else cg / "svc" / name
    if how == "missing":
        target.unlink()
    else:
        target.write_text("\x00not a number\n")
    got = memory.bound(proc)
    if expected is None:  # that limit left out; the host's bound applies
        assert got == memory.Bound(20 * GIB, 32 * GIB, "MemAvailable")
    else:
        assert got == memory.Bound(expected, 4 * GIB, str(cg / "svc"))


def test_a_level_that_cannot_be_read_leaves_the_limits_above_it(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    ctr = cg / "pod" / "ctr"
    _v2(ctr, str(30 * GIB), GIB, 0)
    (ctr / "memory.current").unlink()
    _v2(cg / "pod", str(6 * GIB), 6 * GIB, 0)  # the pod is full
    proc = _proc(tmp_path, "0::/pod/ctr\n", [f"/ {cg} cgroup2 rw"])
    assert memory.bound(proc) == memory.Bound(0, 6 * GIB, str(cg / "pod"))


def test_memory_high_is_a_limit_too(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    _v2(cg / "svc", "max", GIB, 0)
    (cg / "svc" / "memory.high").write_text(f"{3 * GIB}\n")  # MemoryHigh=: reclaim from here
    proc = _proc(tmp_path, "0::/svc\n", [f"/ {cg} cgroup2 rw"])
    assert memory.bound(proc) == memory.Bound(2 * GIB, 3 * GIB, str(cg / "svc"))


def test_cgroup_v1_walks_the_ancestors_each_with_its_own_usage(tmp_path: Path) -> None:
    mem = tmp_path / "memory"
    _v1(mem / "slice", 4 * GIB, 4 * GIB, 0, hierarchical=4 * GIB)  # a full slice
    _v1(mem / "slice" / "svc", UNLIMITED_V1, 512 * MIB, 0, hierarchical=4 * GIB)
    proc = _proc(tmp_path, "4:memory:/slice/svc\n", [f"/ {mem} cgroup rw,memory"])
    assert memory.bound(proc) == memory.Bound(0, 4 * GIB, str(mem / "slice"))


@pytest.mark.parametrize("path", ["/other/x", "/../escaped"])
def test_a_cgroup_the_mount_does_not_show_is_not_read(tmp_path: Path, path: str) -> None:
    cg = tmp_path / "cg"
    _v2(cg / "x", str(GIB), 0, 0)  # a same-named cgroup that is not ours
    _v2(cg / "escaped", str(GIB), 0, 0)
    proc = _proc(tmp_path, f"0::{path}\n", [f"/kubepods/pod1 {cg} cgroup2 rw"])
    assert memory.bound(proc).source == "MemAvailable"


def test_without_meminfo_the_bound_is_an_error(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "0::/\n", [])
    (proc / "meminfo").write_text("MemTotal: 1 kB\n")
    with pytest.raises(OSError, match="MemAvailable"):
        memory.bound(proc)


# ------------------------------------------------------------------ a real memory cgroup

_NOT_MOVED = 97  # the shell could not move itself into the cgroup
_CHILD = """
import json, sys
from pathlib import Path
from supervisor.warm import memory, prewarm
b = memory.bound()
plan = prewarm.plan([Path(sys.argv[1])], b.available, 0)
print(json.dumps({"available": b.available, "total": b.total, "source": b.source,
                  "planned": sum(c.length for c in plan.chunks),
                  "left_out": plan.skipped_for_memory}))
"""


@pytest.fixture
def limited_cgroup() -> Iterator[tuple[Path, int]]:
    """A child of this process's memory cgroup with a 256 MiB limit (v2 or v1), or a skip."""
    limit = 256 * MIB
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and not controllers:
            own["v2"] = path
        elif "memory" in controllers.split(","):
            own["v1"] = path
    name = f"kimi-serve-test-{uuid.uuid4().hex[:8]}"
    candidates: list[tuple[Path, str]] = []
    top = Path("/sys/fs/cgroup")
    for root in (top, top / "unified"):
        controllers_file = root / "cgroup.controllers"
        if (
            "v2" in own
            and controllers_file.exists()
            and "memory" in controllers_file.read_text().split()
        ):
            candidates.append((root / own["v2"].lstrip("/") / name, "memory.max"))
    if "v1" in own:
        candidates.append((top / "memory" / own["v1"].lstrip("/") / name, "memory.limit_in_bytes"))
    for d, limit_file in candidates:
        try:
            d.mkdir()
        except OSError:
            continue
        try:
            (d / limit_file).write_text(str(limit))
        except OSError:
            d.rmdir()
            continue
        try:
            yield d, limit
        finally:
            d.rmdir()
        return
    pytest.skip("no writable memory cgroup here (needs root and a delegated memory controller)")


def test_in_a_real_limited_cgroup_the_plan_fits_the_limit(
    tmp_path: Path, limited_cgroup: tuple[Path, int]
) -> None:
    d, limit = limited_cgroup
    weights = tmp_path / "w.safetensors"
    with weights.open("wb") as f:
        for _ in range(48):  # 384 MiB: more than the cgroup may hold
            f.write(os.urandom(8 * MIB))
    prewarm.evict(weights)
    procs = d / "cgroup.procs"
    done = subprocess.run(
        [
            "/bin/sh",
            "-c",
            f'(echo $$ > {procs}) 2>/dev/null || exit {_NOT_MOVED}; exec "$0" -c "$1" "$2"',
            sys.executable,
            _CHILD,
            str(weights),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode == _NOT_MOVED:
        pytest.skip(f"a process cannot be moved into {d} here (cgroup delegation)")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["source"] == str(d) and got["total"] == limit
    assert 0 < got["available"] <= limit
    assert got["planned"] <= got["available"] and got["left_out"] >= 384 * MIB - limit
    # Outside it, the same file is planned whole (the host has the memory).
    host = memory.bound()
    if host.available > 2 * 384 * MIB:
        whole = prewarm.plan([weights], host.available, 0)
        assert sum(c.length for c in whole.chunks) + whole.resident_before >= 384 * MIB
