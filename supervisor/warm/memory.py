"""The memory a prewarm may fill: the host's, and the memory cgroup's that the daemon runs in.

/proc/meminfo speaks for the host. In a container, or a unit with `MemoryMax=`, the page cache
that the readers fill is charged to the daemon's memory cgroup (SGLang's own pages are charged
to the same one: it is our child), and at the cgroup's limit the kernel reclaims within it: a
prewarm planned by MemAvailable alone would read the model past the limit and evict its own
first files, and press SGLang's cgroup while it allocates. So the bound is the smaller of:

- the host: MemAvailable (and MemTotal for the default headroom);
- each memory cgroup from ours up to the root that has a limit: its limit minus its working
  set, where the working set is its usage minus its inactive file pages (the kernel reclaims
  those first; this is the kubelet's `working_set_bytes` and what `docker stats` shows).

cgroup v2 (`memory.max`, `memory.current`, `memory.stat: inactive_file`, every ancestor read)
and v1 (`memory.limit_in_bytes`, `memory.usage_in_bytes`, `memory.stat: total_inactive_file`;
`hierarchical_memory_limit` is already the smallest limit above) are both read. Where the
daemon's cgroup is not visible (a container without its own cgroup namespace shows the host's
path in /proc/self/cgroup while the mount is its own cgroup), the mount's root is read. Any file
that cannot be read leaves that bound out: the host's bound always applies.
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


def _meminfo(key: str, proc: Path) -> int:
    for line in (proc / "meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no {key} in {proc / 'meminfo'}")


def host_available(proc: Path = Path("/proc")) -> int:
    """MemAvailable from /proc/meminfo, in bytes."""
    return _meminfo("MemAvailable", proc)


def host_total(proc: Path = Path("/proc")) -> int:
    return _meminfo("MemTotal", proc)


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


def _directory(mount: _Mount, path: str) -> Path:
    rel = path
    if mount.root != "/" and (path == mount.root or path.startswith(mount.root + "/")):
        rel = path[len(mount.root) :]
    d = mount.point / rel.lstrip("/")
    return d if d.is_dir() else mount.point  # not visible from here: the mount's own top


def _stat(d: Path, key: str) -> int:
    for line in (d / "memory.stat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _read_int(p: Path) -> int | None:
    text = p.read_text().strip()
    return None if text == "max" else int(text)


def _v2_bounds(mount: _Mount, d: Path) -> Iterator[tuple[int, int, Path]]:
    """(limit, working set, directory) of every cgroup from d up to the mount with a limit."""
    while True:
        limit_file = d / "memory.max"
        if limit_file.exists():
            limit = _read_int(limit_file)
            if limit is not None:
                usage = _read_int(d / "memory.current") or 0
                yield limit, max(0, usage - _stat(d, "inactive_file")), d
        if d == mount.point or d.parent == d:
            return
        d = d.parent


def _v1_bound(d: Path) -> tuple[int, int, Path] | None:
    limit = _read_int(d / "memory.limit_in_bytes")
    hierarchical = _stat(d, "hierarchical_memory_limit")
    candidates = [x for x in (limit, hierarchical) if x]
    if not candidates or min(candidates) >= _V1_UNLIMITED:
        return None
    usage = _read_int(d / "memory.usage_in_bytes") or 0
    return min(candidates), max(0, usage - _stat(d, "total_inactive_file")), d


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
        if path is None:
            continue
        try:
            d = _directory(m, path)
            if m.version == 2:
                found.extend(_v2_bounds(m, d))
            elif (b := _v1_bound(d)) is not None:
                found.append(b)
        except (OSError, ValueError):
            continue
    return found


def bound(proc: Path = Path("/proc")) -> Bound:
    """The memory a prewarm may fill now: the smallest of the host's and every limit's.
    Raises OSError only when /proc/meminfo cannot be read."""
    best = Bound(host_available(proc), host_total(proc), "MemAvailable")
    for limit, working_set, d in cgroup_bounds(proc):
        free = max(0, limit - working_set)
        if free < best.available:
            best = Bound(free, min(best.total, limit), str(d))
        else:
            best = Bound(best.available, min(best.total, limit), best.source)
    return best


def available() -> int:
    return bound().available


def total() -> int:
    return bound().total
