"""SGLang's compile caches: one persistent root, set through SGLang's environment, and checked.

A cold start of a large model compiles kernels for many minutes (DeepGEMM alone "typically
10-20 mins" without its cache, sglang#5580; ~30 min for 128K kernel variants, sglang#18823; a
cache that was not kept recompiled on every start, sglang#29170). Every JIT SGLang may use is
pointed under `warm.cache_dir`, so a relaunch finds what the last one compiled, and a volume or
`CacheDirectory=` keeps them all. An entry of `sglang.env` (or a profile's env) for the same
variable wins. The variables, as SGLang 0.5.23 reads them (docs/sglang.md, "Compile caches"):

- `SGLANG_CACHE_DIR` (SGLang's own root: CuTe AOT objects, TileLang; in 0.5.23 it also sets the
  defaults of triton, inductor, CUDA and flashinfer, `srt/environ.py:2308`);
- `SGLANG_DG_CACHE_DIR` (DeepGEMM, copied to `DG_JIT_CACHE_DIR`), `SGLANG_JIT_CACHE_DIR`;
- `TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`, `TORCH_EXTENSIONS_DIR`;
- `FLASHINFER_WORKSPACE_BASE` (flashinfer appends `.cache/flashinfer` itself);
- `CUDA_CACHE_PATH` (the driver's PTX JIT cache, ComputeCache).

Who may write them is checked first (`owner_problems`: `check` and `preflight` fail, the daemon
exits 78): SGLang runs what it finds there, so a directory another user can write is theirs to
fill with kernels of their own. What else is checked (`check`, `preflight`; warnings, since a
lost cache costs compile time, never correctness): a directory that is missing (and whether it
can be created), not writable, or not persistent: tmpfs/ramfs, systemd's PrivateTmp (removed
when the unit stops), a container's own writable layer (gone with the container).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Cache:
    name: str  # as /status.last_load.caches names it
    env: str  # the variable SGLang (or the library under it) reads
    subdir: str  # under warm.cache_dir


CACHES: tuple[Cache, ...] = (
    Cache("sglang", "SGLANG_CACHE_DIR", "sglang"),
    Cache("deepgemm", "SGLANG_DG_CACHE_DIR", "deep_gemm"),
    Cache("sglang_jit", "SGLANG_JIT_CACHE_DIR", "sglang_jit"),
    Cache("inductor", "TORCHINDUCTOR_CACHE_DIR", "inductor"),
    Cache("triton", "TRITON_CACHE_DIR", "triton"),
    Cache("flashinfer", "FLASHINFER_WORKSPACE_BASE", "flashinfer"),
    Cache("cuda", "CUDA_CACHE_PATH", "nv"),
    Cache("torch_extensions", "TORCH_EXTENSIONS_DIR", "torch_extensions"),
)

# File systems whose content does not outlive the machine (or the mount).
VOLATILE_FS = frozenset({"tmpfs", "ramfs"})
# A container's root: its writable layer goes with the container (Kubernetes, Docker).
CONTAINER_FS = frozenset({"overlay", "aufs"})
# Sizes are summed over at most this many entries: a cache of 128K kernels must not hold up a
# launch; the size is then a lower bound ("truncated").
SIZE_MAX_ENTRIES = 200_000


def env(root: str) -> dict[str, str]:
    """The variables of every cache, under `root`. Pure."""
    return {c.env: os.path.join(root, c.subdir) for c in CACHES}


def paths(launch_env: Mapping[str, str]) -> dict[str, str]:
    """Each cache's directory in a launch's environment (`sglang.argv.build`'s `env`)."""
    return {c.name: launch_env[c.env] for c in CACHES if launch_env.get(c.env)}


# ------------------------------------------------------------------ persistence


@dataclass(frozen=True)
class Mount:
    point: str
    root: str  # the part of the source file system mounted there (a bind's source)
    fstype: str


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def parse_mountinfo(text: str) -> list[Mount]:
    """/proc/self/mountinfo -> mounts (proc(5): `id parent maj:min root point opts ... - fs`)."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        out.append(Mount(_unescape(fields[4]), _unescape(fields[3]), right.split()[0]))
    return out


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount a path is on: the longest mount point that contains it (the last one mounted
    at that point, as the kernel sees it)."""
    best: Mount | None = None
    for m in mounts:
        inside = path == m.point or path.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def not_persistent(path: str, mounts: list[Mount]) -> str | None:
    """Why a directory's content would not outlive the unit, the container or the machine;
    None when it would."""
    m = mount_of(path, mounts)
    if m is None:
        return None
    if m.fstype in VOLATILE_FS:
        return f"on {m.fstype} ({m.point}): emptied at every reboot or remount"
    if "systemd-private-" in m.root:
        return f"under systemd's PrivateTmp ({m.point}): removed when the unit stops"
    if m.fstype in CONTAINER_FS and m.point == "/":
        return (
            f"on the container's own writable layer ({m.fstype} /): gone when the container "
            "is replaced; mount a volume there"
        )
    return None


def _existing(path: str) -> str:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p)


def problems(dirs: Mapping[str, str], mounts: list[Mount]) -> list[str]:
    """One line per kind of problem (missing and not creatable, not writable, not persistent),
    naming the caches it concerns; nothing when every directory is fine."""
    found: dict[str, list[str]] = {}
    for name, path in dirs.items():
        why = _problem(path, mounts)
        if why is not None:
            found.setdefault(why, []).append(f"{name} ({path})")
    return [f"cache {', '.join(names)}: {why}" for why, names in found.items()]


def _problem(path: str, mounts: list[Mount]) -> str | None:
    if not os.path.isabs(path):
        return "not an absolute path; it would follow SGLang's working directory"
    real = os.path.realpath(path)
    if os.path.exists(real) and not os.path.isdir(real):
        return "exists but is not a directory"
    if not os.path.isdir(real):
        parent = _existing(real)
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"missing, and {parent} is not writable by uid {os.geteuid()}: not creatable"
    elif not os.access(real, os.W_OK | os.X_OK):
        return f"not writable by uid {os.geteuid()}: SGLang would compile on every start"
    why = not_persistent(real if os.path.isdir(real) else _existing(real), mounts)
    return None if why is None else f"not persistent: {why}"


# ------------------------------------------------------------------ who may write them


def trusted_owners(state_dir: str) -> tuple[frozenset[int], frozenset[int]]:
    """(uids, gids) a cache directory may belong to: root, this process's user (the service
    user, for the daemon) and the state directory's owner (the service user, for root's
    `check` and `preflight`); the groups of these, and this process's own (a pod's fsGroup)."""
    uids = {0, os.geteuid()}
    gids = {os.getegid(), *os.getgroups()}
    try:
        st = os.stat(state_dir)
    except OSError:
        pass
    else:
        uids.add(st.st_uid)
        gids.add(st.st_gid)
    return frozenset(uids), frozenset(gids)


def owner_problem(path: str, uids: frozenset[int], gids: frozenset[int]) -> str | None:
    """Why another user could replace what SGLang loads from `path` (compiled kernels it runs
    as the service user, or as root), or None. The directory (and each existing one above it)
    must belong to root or the service user, not be writable by others (unless sticky, as
    /tmp: then only its own entry's owner counts), and be group-writable only for a group of
    the service user's (a pod's fsGroup). A missing directory is made 0700 by the daemon."""
    p = Path(os.path.realpath(path))
    first = True  # the directory itself: sticky does not make it safe (a parent it does)
    while True:
        try:
            st = os.stat(p)
        except OSError:
            st = None
        if st is not None:
            mode = stat.S_IMODE(st.st_mode)
            sticky = bool(st.st_mode & stat.S_ISVTX) and not first
            if st.st_uid not in uids:
                return f"{p} belongs to uid {st.st_uid}, not to root or the service user"
            if st.st_mode & stat.S_IWOTH and not sticky:
                return f"{p} is writable by every user (mode {mode:04o})"
            if st.st_mode & stat.S_IWGRP and st.st_gid not in gids and not sticky:
                return f"{p} is writable by group {st.st_gid}, not a group of the service user"
        first = False
        if p == p.parent:
            return None
        p = p.parent


def owner_problems(
    dirs: Mapping[str, str], uids: frozenset[int], gids: frozenset[int]
) -> list[str]:
    """`owner_problem` of each cache directory, one line per problem naming the caches."""
    found: dict[str, list[str]] = {}
    for name, path in dirs.items():
        why = owner_problem(path, uids, gids)
        if why is not None:
            found.setdefault(why, []).append(name)
    return [
        f"cache {', '.join(names)}: {why}: its owner could replace the kernels SGLang loads"
        for why, names in found.items()
    ]


def read_mounts() -> list[Mount]:
    try:
        return parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return []


# ------------------------------------------------------------------ before a launch


def prepare(dirs: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Create missing cache directories (0700) and measure each: /status.last_load.caches.
    Blocking (a directory walk): the daemon runs it through supervisor.threads."""
    out: dict[str, dict[str, Any]] = {}
    for name, path in dirs.items():
        entry: dict[str, Any] = {"path": path, "existed": os.path.isdir(path)}
        if not entry["existed"]:
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
            except OSError as exc:
                entry["error"] = f"cannot create: {exc.strerror or exc}"
        size, files, truncated = _size(path)
        entry.update(bytes=size, files=files, truncated=truncated)
        out[name] = entry
    return out


def _walk(path: str) -> Iterator[os.DirEntry[str]]:
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    yield e
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EACCES, errno.ENOTDIR):
                raise


def _size(path: str) -> tuple[int, int, bool]:
    total = files = seen = 0
    try:
        for e in _walk(path):
            seen += 1
            if seen > SIZE_MAX_ENTRIES:
                return total, files, True
            if e.is_file(follow_symlinks=False):
                files += 1
                total += e.stat(follow_symlinks=False).st_size
    except OSError:
        pass  # a size is a report; an unreadable corner only makes it smaller
    return total, files, False
