"""Page-cache prewarm: the model's weight files read into the page cache before SGLang wants them.

A cold load of a large model is mostly weights read from disk (fergusfinn.com "fast sglang
starts": 531 s of a 695 s cold start on 8xB200, 31 s warm). The daemon knows a launch is coming
before SGLang does: during the backoff and the cleaning it can read the files with several
readers at once, so SGLang's own (single-threaded, page-fault driven, for mmap'd safetensors)
reads hit memory. docs/benchmarks.md has what it gains, and when it does not.

- What is already resident is skipped: `mincore(2)` on a read-only `mmap` of each file says
  which pages are in the page cache without touching them (no copy, no I/O). `preadv2` with
  `RWF_NOWAIT` would answer the same but copies the data it finds and is not supported on
  every file system.
- Bounded by memory: no more than the available memory minus `warm.prewarm_headroom` is read (a
  model that does not fit would evict its own first files), and the readers stop as soon as it
  falls below the headroom (SGLang is allocating meanwhile). Available is the smaller of the
  host's MemAvailable and what the daemon's memory cgroup leaves below its limit (`memory`).
- It never holds the launch back: the launch goes ahead when the cleaning is done, the readers
  go on beside SGLang's load, and stop when its weights are in (the port opens) or the launch
  ends.

The readers are plain blocking reads, run through the one thread adapter (supervisor.threads).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.warm import memory

# What SGLang's loaders read (model_loader/weight_utils.py: safetensors first, then .bin/.pt);
# GGUF and the quantisation formats' own files read the same way.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHUNK = 8 << 20  # one read; also the unit in which residency is judged
MINCORE_WINDOW = 1 << 30  # mapped and probed at a time (a 1 GiB window: a 256 KiB vector)
MEMINFO_EVERY = 64 << 20  # MemAvailable is read again after this many bytes


# ------------------------------------------------------------------ residency (mincore)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = mmap.PAGESIZE
# mincore's vector: bit 0 of each byte says resident; the others are reserved.
_LOW_BIT = bytes(b & 1 for b in range(256))


def open_regular(path: str | os.PathLike[str]) -> int:
    """A weight file's descriptor, only if it is a regular file (after links: a model
    directory of the hub's cache is links to blobs). Never waits on a FIFO (O_NONBLOCK);
    OSError otherwise, as for a file that cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def resident_pages(path: str | os.PathLike[str], limit: int | None = None) -> tuple[bytearray, int]:
    """(one byte per page of the file's first `limit` bytes (all: None): 1 if in the page
    cache, the file's size). Maps nothing writable and faults nothing in. The vector is sized
    by `limit`, never by what the file claims to hold (a sparse file can claim an exbibyte)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        probed = size if limit is None else min(size, max(0, limit))
        pages = bytearray((probed + PAGE - 1) // PAGE)
        for start in range(0, probed, MINCORE_WINDOW):
            length = min(MINCORE_WINDOW, probed - start)
            addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
            if addr is None or addr == _MAP_FAILED:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap: {os.strerror(err)}", str(path))
            try:
                vec = ctypes.create_string_buffer((length + PAGE - 1) // PAGE)
                if _libc.mincore(addr, length, vec) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"mincore: {os.strerror(err)}", str(path))
                first = start // PAGE
                raw = vec.raw[: (length + PAGE - 1) // PAGE]
                pages[first : first + len(raw)] = raw.translate(_LOW_BIT)
            finally:
                _libc.munmap(addr, length)
        return pages, size
    finally:
        os.close(fd)


MAX_EXTENTS = 4096  # data regions looked up per file; past them the rest counts as data


def data_ranges(path: str | os.PathLike[str], limit: int) -> list[tuple[int, int]]:
    """The (start, end) byte ranges of the file's first `limit` bytes that hold data, not holes
    (SEEK_DATA / SEEK_HOLE): a sparse file's holes are nothing SGLang reads from disk, and a
    file that claims an exbibyte and holds nothing has nothing to prewarm. A file system that
    cannot tell reports the whole file as data (the kernel's generic answer); one that refuses
    the question, likewise."""
    try:
        fd = open_regular(path)
    except OSError:
        return [(0, limit)]
    try:
        out: list[tuple[int, int]] = []
        pos = 0
        while pos < limit:
            if len(out) >= MAX_EXTENTS:
                out.append((pos, limit))
                break
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data after pos
                    break
                return [(0, limit)]
            if start >= limit:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), limit)
            out.append((start, end))
            pos = end
        return out
    finally:
        os.close(fd)


def resident_bytes(path: str | os.PathLike[str]) -> int:
    pages, size = resident_pages(path)
    return min(size, pages.count(1) * PAGE)


# ------------------------------------------------------------------ what to read


def weight_files(model_paths: Iterable[str]) -> list[Path]:
    """The weight files of each local model directory, in the order SGLang reads them (sorted
    by name). A hub id or a missing path has none: nothing to prewarm."""
    out: list[Path] = []
    for model in model_paths:
        p = Path(model)
        if not p.is_dir():
            continue
        # is_file() follows links (the hub's cache) and leaves out FIFOs, devices, directories;
        # each file is opened again as a regular file only (`open_regular`).
        out.extend(sorted(f for f in p.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file()))
    return out


@dataclass(frozen=True)
class Chunk:
    path: Path
    offset: int
    length: int


@dataclass
class Plan:
    chunks: list[Chunk]
    total: int  # bytes of all the files
    resident_before: int  # of which already in the page cache
    budget: int  # bytes that may be read (memory bound)
    skipped_for_memory: int  # non-resident bytes left out by the budget


def default_headroom(total: int) -> int:
    """10% of the memory, at least 2 GiB: what SGLang and the rest of the host keep."""
    return max(total // 10, 2 << 30)


def plan(
    files: Iterable[Path],
    available: int,
    headroom: int,
    residency: Callable[[Path, int], tuple[bytearray, int]] | None = None,
    extents: Callable[[Path, int], list[tuple[int, int]]] | None = None,
) -> Plan:
    """The chunks to read: each one with a page not yet resident, in file order, until the
    budget (available - headroom) is spent.

    Each file is probed only as far as a chunk could still be planned: the budget left plus
    `available` (what of it may already be resident: clean page cache counts as available).
    What lies beyond is counted in `total` and, unprobed, in `skipped_for_memory`. So the work
    and the vectors are bounded by memory, not by file sizes (a 1 EiB sparse file is one
    bounded probe). Chunks holding no data (a sparse file's holes, `data_ranges`) are not
    planned at all."""
    residency = residency or resident_pages  # looked up now: tests record the real one
    extents = extents or data_ranges
    budget = max(0, available - headroom)
    chunks: list[Chunk] = []
    total = resident = planned = left_out = 0
    per_chunk = CHUNK // PAGE
    for path in files:
        try:
            pages, size = residency(path, budget - planned + max(0, available))
        except OSError:
            continue  # unreadable here, or not a regular file; SGLang will say so itself
        total += size
        probed = min(size, len(pages) * PAGE)
        resident += min(probed, pages.count(1) * PAGE)
        left_out += size - probed
        data = extents(path, probed)
        for offset in _chunk_offsets(data):
            first = offset // PAGE
            if 0 not in pages[first : first + per_chunk]:
                continue
            length = min(CHUNK, probed - offset)
            if planned + length > budget:
                left_out += length
                continue
            chunks.append(Chunk(path, offset, length))
            planned += length
    return Plan(chunks, total, resident, budget, left_out)


def _chunk_offsets(data: list[tuple[int, int]]) -> Iterable[int]:
    """The offsets of the chunks (CHUNK-aligned) that hold any of the data ranges, in order."""
    last = -1
    for start, end in data:
        for offset in range(start - start % CHUNK, end, CHUNK):
            if offset > last:
                last = offset
                yield offset


# ------------------------------------------------------------------ reading


@dataclass
class Progress:
    """Shared by the readers (under `lock`) and read by the loop for STATUS= and /status."""

    planned: int = 0
    total: int = 0
    resident_before: int = 0
    read: int = 0
    started: float = 0.0
    ended: float | None = None
    stopped: str | None = None  # why it ended before reading everything planned
    files: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, n: int) -> None:
        with self.lock:
            self.read += n

    def document(self, now: float) -> dict[str, Any]:
        """/status.last_load.prewarm (contract: bytes, seconds, resident_before)."""
        end = self.ended if self.ended is not None else now
        return {
            "bytes": self.read,
            "seconds": round(end - self.started, 3),
            "resident_before": self.resident_before,
            "planned": self.planned,
            "total": self.total,
            "files": self.files,
            "done": self.ended is not None,
            "stopped": self.stopped,
        }


class Readers:
    """The work of the parallel readers: each call of `work()` (one per reader thread) takes
    the next chunk until none are left, the stop event is set, or memory runs short."""

    def __init__(
        self,
        chunks: Iterable[Chunk],
        progress: Progress,
        stop: threading.Event,
        headroom: int,
        available: Callable[[], int] = memory.available,
    ) -> None:
        self._queue = deque(chunks)
        self._lock = threading.Lock()
        self._since_check = 0
        self.progress = progress
        self.stop = stop
        self.headroom = headroom
        self.available = available

    def _next(self, n_done: int) -> Chunk | None:
        with self._lock:
            self._since_check += n_done
            if self._since_check >= MEMINFO_EVERY:
                self._since_check = 0
                if self.available() < self.headroom:
                    self.progress.stopped = "memory: available memory below warm.prewarm_headroom"
                    self.stop.set()
            if self.stop.is_set() or not self._queue:
                return None
            return self._queue.popleft()

    def work(self) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        fds: dict[Path, int] = {}
        done = 0
        try:
            while (chunk := self._next(done)) is not None:
                fd = fds.get(chunk.path)
                if fd is None:
                    fd = fds[chunk.path] = open_regular(chunk.path)
                done = 0
                while done < chunk.length and not self.stop.is_set():
                    n = os.preadv(fd, [view[: chunk.length - done]], chunk.offset + done)
                    if n <= 0:
                        break  # the file shrank: nothing more to read here
                    done += n
                    self.progress.add(n)
        finally:
            for fd in fds.values():
                os.close(fd)


def evict(path: str | os.PathLike[str]) -> None:
    """Drop a file's clean pages from the page cache (tests and the bench: a cold file without
    dropping every cache on the host)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def summary_line(p: Progress, now: float) -> str:
    """For STATUS= and the log: `prewarm 1.2/3.4 GiB`."""
    gib = 1 << 30
    line = f"prewarm {p.read / gib:.1f}/{p.planned / gib:.1f} GiB"
    if p.ended is not None:
        line += f" in {p.ended - p.started:.0f} s"
    elif p.started:
        line += f", {now - p.started:.0f} s"
    return line


def model_paths(model_path: str, args: Mapping[str, Any]) -> list[str]:
    """The model and its draft model (speculative decoding), as the launch names them."""
    out = [model_path]
    for flag in ("speculative-draft-model-path", "speculative-draft-model"):
        value = args.get(flag)
        if isinstance(value, str) and value not in out:
            out.append(value)
    return out
