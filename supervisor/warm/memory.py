"""The memory a prewarm may fill: the host's, and the memory cgroup's that the daemon runs in.

/proc/meminfo speaks for the host. In a container, or a unit with `MemoryMax=`, the page cache
that the readers fill is charged to the daemon's memory cgroup (SGLang's own pages are charged
to the same one: it is our child), and at the cgroup's limit the kernel reclaims within it: a
prewarm planned by MemAvailable alone would read the model past the limit and evict its own
first files, and press SGLang's cgroup while it allocates. So the bound is the smaller of:

- the host: MemAvailable (and MemTotal for the default headroom);
- each memory cgroup from ours up to the top of the mount that has a limit: its limit minus its
  own working set, where the working set is its usage minus its inactive file pages (the
  kernel reclaims those first; this is the kubelet's `working_set_bytes` and what `docker
  stats` shows; unknown inactive pages count as working set).

cgroup v2: `memory.max` and `memory.high` (reclaim starts there), `memory.current`,
`memory.stat: inactive_file`. v1: `memory.limit_in_bytes`, `memory.usage_in_bytes`,
`memory.stat: total_inactive_file`; and `hierarchical_memory_limit`, the smallest limit above,
for an ancestor out of sight (counted against our own working set: its other members are out of
sight too). Where /proc/self/cgroup names a path the mount does not show (a container without
its own cgroup namespace names the host's path while its mount is its own cgroup), the mount's
top is read; a path outside a mounted subtree, or above the namespace (`/..`), is not read. A
level whose limit or usage cannot be read is left out, the others still count; the host's bound
always applies.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# v1 says "no limit" with the largest page-aligned 64-bit value; v2 with "max".
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class Bound:
    available: int
    total: int
    source: str  # "MemAvailable" or the cgroup directory whose limit is the smaller


@dataclass(frozen=True)
class _Mount:
    root: str  # the cgroup path the mount shows as its top
    point: Path
    version: int


def _host(proc: Path) -> tuple[int, int]:
    """(MemAvailable, MemTotal) from one read of /proc/meminfo, in bytes."""
    found: dict[str, int] = {}
    for line in (proc / "meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("MemAvailable", "MemTotal"):
            found[key] = int(value.split()[0]) * 1024
    for key in ("MemAvailable", "MemTotal"):
        if key not in found:
            raise OSError(f"no {key} in {proc / 'meminfo'}")
    return found["MemAvailable"], found["MemTotal"]


def _mounts(proc: Path) -> Iterator[_Mount]:
    """Mounts of the memory controller (v1) and of the unified hierarchy (v2)."""
    for line in (proc / "self" / "mountinfo").read_text().splitlines():
        fields = line.split()
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        if len(fields) < sep + 4 or len(fields) < 5:
            continue
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        point = Path(fields[4].replace("\\040", " "))
        if fstype == "cgroup2":
            yield _Mount(fields[3], point, 2)
        elif fstype == "cgroup" and "memory" in options:
            yield _Mount(fields[3], point, 1)


def _own_paths(proc: Path) -> dict[int, str]:
    """This process's cgroup path per hierarchy version (from /proc/self/cgroup)."""
    own: dict[int, str] = {}
    for line in (proc / "self" / "cgroup").read_text().splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            own.setdefault(2, path)
        elif "memory" in controllers.split(","):
            own[1] = path
    return own


def _directory(mount: _Mount, path: str) -> Path | None:
    """The cgroup's directory under the mount, or None when it is not one this mount shows."""
    if path.startswith("/.."):
        return None  # moved outside its cgroup namespace: no ancestor of it is visible
    rel = path
    if mount.root != "/":
        if path != mount.root and not path.startswith(mount.root + "/"):
            return None  # outside the mounted subtree
        rel = path[len(mount.root) :]
    d = mount.point / rel.lstrip("/")
    if d.is_dir():
        return d
    # A container without its own cgroup namespace names the host's path; its mount is its
    # own cgroup.
    return mount.point if mount.root == "/" else None


def _stat(d: Path, key: str) -> int:
    for line in (d / "memory.stat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    raise ValueError(f"no {key} in {d / 'memory.stat'}")


def _inactive_file(d: Path, key: str) -> int:
    """The reclaimable part of a cgroup's charge; 0 when unknown (then all of it counts)."""
    try:
        return _stat(d, key)
    except (OSError, ValueError):
        return 0


def _read_int(p: Path) -> int | None:
    text = p.read_text().strip()
    return None if text == "max" else int(text)


def _read_if_there(p: Path) -> int | None:
    try:
        return _read_int(p)
    except FileNotFoundError:
        return None


def _v2_level(d: Path) -> tuple[int, int, Path] | None:
    limits = [
        x for x in (_read_int(d / "memory.max"), _read_if_there(d / "memory.high")) if x is not None
    ]
    if not limits:
        return None
    usage = _read_int(d / "memory.current") or 0
    return min(limits), max(0, usage - _inactive_file(d, "inactive_file")), d


def _v1_level(d: Path) -> tuple[int, int, Path] | None:
    limit = _read_int(d / "memory.limit_in_bytes")
    if limit is None or limit >= _V1_UNLIMITED:
        return None
    return limit, _v1_working_set(d), d


def _levels(mount: _Mount, d: Path) -> Iterator[tuple[int, int, Path]]:
    """(limit, working set, directory) of every cgroup from d up to the mount with a limit.
    A level whose files cannot be read is left out; the others still count."""
    level = _v2_level if mount.version == 2 else _v1_level
    while True:
        try:
            found = level(d)  # no limit file (the top of a hierarchy): OSError, left out
        except (OSError, ValueError):
            found = None
        if found is not None:
            yield found
        if d == mount.point or d.parent == d:
            return
        d = d.parent


def _v1_hierarchical(d: Path) -> int | None:
    """v1's smallest limit from d up, invisible ancestors included (a container without its
    own cgroup namespace sees only its own cgroup)."""
    try:
        limit = _stat(d, "hierarchical_memory_limit")
    except (OSError, ValueError):
        return None
    return None if limit >= _V1_UNLIMITED else limit


def cgroup_bounds(proc: Path = Path("/proc")) -> list[tuple[int, int, Path]]:
    """(limit, working set, directory) of each memory cgroup above the daemon with a limit."""
    try:
        own = _own_paths(proc)
        mounts = list(_mounts(proc))
    except (OSError, ValueError):
        return []
    found: list[tuple[int, int, Path]] = []
    for m in mounts:
        path = own.get(m.version)
        d = None if path is None else _directory(m, path)
        if d is None:
            continue
        levels = list(_levels(m, d))
        found.extend(levels)
        hierarchical = _v1_hierarchical(d) if m.version == 1 else None
        if hierarchical is not None and all(hierarchical < limit for limit, _, _ in levels):
            # An ancestor out of sight is the tighter one; its usage is out of sight too, so
            # only ours can be counted against it (an upper bound on what is free).
            try:
                found.append((hierarchical, _v1_working_set(d), d))
            except (OSError, ValueError):
                continue
    return found


def _v1_working_set(d: Path) -> int:
    usage = _read_int(d / "memory.usage_in_bytes") or 0
    return max(0, usage - _inactive_file(d, "total_inactive_file"))


def bound(proc: Path = Path("/proc")) -> Bound:
    """The memory a prewarm may fill now: the smallest of the host's and every limit's.
    Raises OSError only when /proc/meminfo cannot be read."""
    host_available, host_total = _host(proc)
    limits = cgroup_bounds(proc)
    free = [(host_available, "MemAvailable")]
    free += [(max(0, limit - working_set), str(d)) for limit, working_set, d in limits]
    available, source = min(free, key=lambda f: f[0])  # the host's on a tie
    return Bound(available, min([host_total, *(limit for limit, _, _ in limits)]), source)


def available() -> int:
    return bound().available
