"""Page-cache prewarm on real files and the real page cache (mincore, posix_fadvise)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from supervisor import config
from supervisor.core.machine import State, Transitioned
from supervisor.warm import Warm, prewarm

MIB = 1 << 20


def _cold_file(path: Path, size: int) -> Path:
    with path.open("wb") as f:
        f.write(os.urandom(size))
    prewarm.evict(path)
    return path


def _read(path: Path, offset: int, length: int) -> None:
    """Read exactly this range into the page cache (no readahead beyond it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        done = 0
        while done < length:
            done += len(os.pread(fd, min(MIB, length - done), offset + done))
    finally:
        os.close(fd)


# The kernel may reclaim a clean page at any moment (a neighbour's memory pressure, a memory
# cgroup at its limit): a page read is resident only until then. So the tests below hold the
# code to the residency mincore gave it, and claim of a read only that it reached the page
# cache, never that it is still all there later.


def _recorded_residency(
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[Path, bytearray, int]]:
    seen: list[tuple[Path, bytearray, int]] = []
    real = prewarm.resident_pages

    def recording(path: str | os.PathLike[str], limit: int | None = None) -> tuple[bytearray, int]:
        pages, size = real(path, limit)
        seen.append((Path(path), pages, size))
        return pages, size

    monkeypatch.setattr(prewarm, "resident_pages", recording)
    return seen


def _cold_chunks(pages: bytearray, size: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk with a page missing: what a plan over it reads."""
    per_chunk = prewarm.CHUNK // prewarm.PAGE
    return [
        (offset, min(prewarm.CHUNK, size - offset))
        for offset in range(0, size, prewarm.CHUNK)
        if 0 in pages[offset // prewarm.PAGE : offset // prewarm.PAGE + per_chunk]
    ]


def _cold_bytes(seen: list[tuple[Path, bytearray, int]]) -> int:
    return sum(length for _, pages, size in seen for _, length in _cold_chunks(pages, size))


def _evicted_or_skip(path: Path) -> None:
    # A file system without a page cache of its own (or one that ignores DONTNEED) cannot
    # show the difference.
    if prewarm.resident_bytes(path) > 0:
        pytest.skip(f"posix_fadvise(DONTNEED) does not evict on this file system ({path})")


def test_mincore_sees_what_was_read(tmp_path: Path) -> None:
    f = _cold_file(tmp_path / "w.safetensors", 32 * MIB)
    _evicted_or_skip(f)
    _read(f, 16 * MIB, 8 * MIB)
    pages, size = prewarm.resident_pages(f)
    assert size == 32 * MIB and len(pages) == size // prewarm.PAGE
    at = (16 * MIB) // prewarm.PAGE
    assert any(pages[at : at + (8 * MIB) // prewarm.PAGE])  # what was read reached the cache
    assert not any(pages[: 16 * MIB // prewarm.PAGE])  # nothing before it was touched


def test_the_plan_skips_resident_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = _cold_file(tmp_path / "w.safetensors", 40 * MIB)
    _evicted_or_skip(f)
    _read(f, 0, 2 * prewarm.CHUNK)  # the first two chunks are resident now
    seen = _recorded_residency(monkeypatch)
    plan = prewarm.plan([f], available=1 << 50, headroom=0)
    ((_, pages, size),) = seen
    cold = [offset for offset, _ in _cold_chunks(pages, size)]
    assert [c.offset for c in plan.chunks] == cold
    assert plan.resident_before == pages.count(1) * prewarm.PAGE
    assert plan.total == 40 * MIB and plan.skipped_for_memory == 0
    # What was never read is cold; what was read is skipped unless reclaimed already.
    assert cold[-3:] == [2 * prewarm.CHUNK, 3 * prewarm.CHUNK, 4 * prewarm.CHUNK]


def test_the_plan_reads_only_chunks_with_a_page_missing() -> None:
    size = 5 * prewarm.CHUNK - 3 * prewarm.PAGE  # a short last chunk
    n = size // prewarm.PAGE
    per_chunk = prewarm.CHUNK // prewarm.PAGE
    path = Path("w.safetensors")

    def plan_for(pages: bytearray) -> list[int]:
        got = prewarm.plan([path], 1 << 50, 0, residency=lambda *_: (pages, size))
        return [c.offset for c in got.chunks]

    assert plan_for(bytearray(b"\x01") * n) == []  # everything resident: nothing to read
    assert plan_for(bytearray(n)) == [i * prewarm.CHUNK for i in range(5)]
    one_missing = bytearray(b"\x01") * n
    one_missing[3 * per_chunk + 7] = 0
    one_missing[n - 1] = 0
    assert plan_for(one_missing) == [3 * prewarm.CHUNK, 4 * prewarm.CHUNK]
    last = prewarm.plan([path], 1 << 50, 0, residency=lambda *_: (one_missing, size)).chunks[-1]
    assert last.length == prewarm.CHUNK - 3 * prewarm.PAGE


def test_the_plan_stays_within_available_memory_minus_headroom(tmp_path: Path) -> None:
    f = _cold_file(tmp_path / "w.safetensors", 64 * MIB)
    _evicted_or_skip(f)
    plan = prewarm.plan([f], available=(1 << 30) + 20 * MIB, headroom=1 << 30)
    planned = sum(c.length for c in plan.chunks)
    assert planned <= 20 * MIB and planned == 2 * prewarm.CHUNK
    assert plan.skipped_for_memory == 64 * MIB - planned


def test_readers_read_the_plan_into_the_page_cache(tmp_path: Path) -> None:
    files = [_cold_file(tmp_path / f"m-{i}.safetensors", 24 * MIB) for i in range(3)]
    _evicted_or_skip(files[0])
    plan = prewarm.plan(files, available=1 << 50, headroom=0)
    progress = prewarm.Progress(planned=sum(c.length for c in plan.chunks))
    readers = prewarm.Readers(plan.chunks, progress, threading.Event(), headroom=0)
    workers = [threading.Thread(target=readers.work) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert progress.read == 3 * 24 * MIB and progress.stopped is None
    assert all(prewarm.resident_bytes(f) > 0 for f in files)  # buffered reads: in the cache


def test_readers_stop_when_memory_runs_short(tmp_path: Path) -> None:
    f = _cold_file(tmp_path / "w.safetensors", 3 * prewarm.MEMINFO_EVERY)
    _evicted_or_skip(f)
    plan = prewarm.plan([f], available=1 << 50, headroom=0)
    progress = prewarm.Progress()
    reads: list[int] = []

    def available() -> int:  # SGLang allocating meanwhile: below the headroom at once
        reads.append(progress.read)
        return 0

    stop = threading.Event()
    prewarm.Readers(plan.chunks, progress, stop, headroom=MIB, available=available).work()
    assert stop.is_set() and progress.stopped is not None and "memory" in progress.stopped
    assert reads and progress.read <= prewarm.MEMINFO_EVERY + prewarm.CHUNK
    assert prewarm.resident_bytes(f) < 2 * prewarm.MEMINFO_EVERY


def test_weight_files_of_the_model_and_its_draft(tmp_path: Path) -> None:
    model, draft = tmp_path / "model", tmp_path / "draft"
    for d, names in (
        (model, ["b.safetensors", "a.safetensors", "config.json"]),
        (draft, ["x.bin"]),
    ):
        d.mkdir()
        for n in names:
            (d / n).write_bytes(b"0")
    paths = prewarm.model_paths(str(model), {"speculative-draft-model-path": str(draft)})
    assert paths == [str(model), str(draft)]
    names = [p.name for p in prewarm.weight_files([*paths, "org/hub-id"])]
    assert names == ["a.safetensors", "b.safetensors", "x.bin"]


# ------------------------------------------------------------------ a round, as the daemon runs it


def _cfg(tmp_path: Path, prewarm_mode: str) -> config.Config:
    doc: dict[str, Any] = {
        "sglang": {"python": "/usr/bin/python3", "model_path": str(tmp_path / "model")},
        "state_dir": str(tmp_path / "state"),
        "warm": {
            "prewarm": prewarm_mode,
            "cache_dir": str(tmp_path / "cache"),
            "prewarm_readers": 2,
        },
    }
    return config.parse(yaml.safe_dump(doc), "test.yaml")


def _to(old: State, new: State) -> Transitioned:
    return Transitioned(old, new, "test")


async def test_a_round_reports_caches_and_prewarm_and_skips_resident_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "model").mkdir()
    files = [_cold_file(tmp_path / "model" / f"m-{i}.safetensors", 16 * MIB) for i in range(2)]
    _evicted_or_skip(files[0])
    files[1].read_bytes()  # one file already resident
    seen = _recorded_residency(monkeypatch)
    tasks: list[asyncio.Task[Any]] = []
    loop = asyncio.get_running_loop()
    warm = Warm(_cfg(tmp_path, "auto"), loop.time, lambda c: tasks.append(loop.create_task(c)))

    warm.transitioned(_to(State.STARTING, State.CLEANING), "primary")
    report = warm.current()
    assert report is not None
    await asyncio.wait_for(warm.done.wait(), 60)
    doc = report()
    assert set(doc["caches"]) >= {"deepgemm", "inductor", "triton", "flashinfer", "cuda"}
    assert doc["caches"]["triton"]["existed"] is False and doc["caches"]["triton"]["bytes"] == 0
    pre = doc["prewarm"]
    assert [p.name for p, _, _ in seen] == ["m-0.safetensors", "m-1.safetensors"]
    assert pre["resident_before"] == sum(pages.count(1) for _, pages, _ in seen) * prewarm.PAGE
    assert pre["bytes"] == _cold_bytes(seen)  # only what was not resident was read
    assert not any(seen[0][1]) and pre["bytes"] >= 16 * MIB  # all of the cold file
    assert pre["done"] and pre["stopped"] is None
    assert warm.note().startswith("prewarm 0.0/0.0 GiB in")

    # The next launch finds everything resident: nothing read.
    warm.transitioned(_to(State.WARMING, State.READY), "primary")
    warm.transitioned(_to(State.READY, State.RESTARTING), "primary")
    again = warm.current()
    assert again is not None and again is not report
    warm.transitioned(_to(State.RESTARTING, State.CLEANING), "primary")
    assert warm.current() == again  # the same round goes on through the cleaning
    seen.clear()
    await asyncio.wait_for(warm.done.wait(), 60)
    # Nothing read unless the kernel reclaimed some of it meanwhile (then only that).
    assert again()["prewarm"]["bytes"] == _cold_bytes(seen)
    resident = sum(pages.count(1) for _, pages, _ in seen) * prewarm.PAGE
    assert again()["prewarm"]["resident_before"] == resident > 0


async def test_prewarm_off_still_reports_the_caches(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    tasks: list[asyncio.Task[Any]] = []
    loop = asyncio.get_running_loop()
    warm = Warm(_cfg(tmp_path, "off"), loop.time, lambda c: tasks.append(loop.create_task(c)))
    warm.transitioned(_to(State.STARTING, State.CLEANING), "primary")
    await asyncio.wait_for(warm.done.wait(), 60)
    report = warm.current()
    assert report is not None
    assert report()["prewarm"] is None and report()["caches"]["cuda"]["path"].endswith("/nv")
    assert (tmp_path / "cache" / "deep_gemm").is_dir()
