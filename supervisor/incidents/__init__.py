"""Incident directories: what on-call opens first after a restart nobody asked for.

One directory per such restart, `<dir>/<UTC yyyymmddThhmmssZ>-<reason>-launch<N>/`, mode 0700,
holding `incident.json` (the facts), `log_tail.txt` (what SGLang printed last, the traceback
included) and `stacks.txt` (py-spy stacks taken before the kill, or why there are none).

Written so that a crash never leaves half an incident that looks whole: everything is built in a
hidden temporary directory beside the final one (same filesystem), every file and the directory
fsynced, then renamed into place in one step. Readers ignore hidden entries; leftovers of a
crashed write are swept before the next one.

Bounded so that evidence never costs the host its disk: the newest `incidents.keep` are kept,
all of them together stay under `incidents.max_bytes` (the oldest go first), and while the
filesystem has less than `incidents.min_free_bytes` free only the small incident.json is written,
saying which files were skipped and why. The files can hold user prompts (SGLang's log lines and
crash dumps quote requests): the directories are the service user's alone (docs/incidents.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor import __version__, untrusted
from supervisor.config import IncidentsConfig
from supervisor.incidents.stacks import Capture, render
from supervisor.sglang.logscan import exception_line

INCIDENT_JSON = "incident.json"
LOG_TAIL = "log_tail.txt"
STACKS = "stacks.txt"
FORMAT_VERSION = 1
_TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^(\d{8}T\d{6}Z)-([a-z_]+)-launch(\d+)(?:-(\d+))?$")
# incident.json is small by construction (server_info and the GPU table are bounded below);
# it is written even under the free-space floor, unless not even this much is left.
_JSON_MAX = 256 * 2**10
_SERVER_INFO_MAX = 64 * 2**10
_LOG_TAIL_MAX = 2**20
# What `kimi-serve incidents` (root, often) reads of a directory the service user can write:
# only regular files, not through a link, at most this much (docs/incidents.md).
_READ_JSON_MAX = 4 * _JSON_MAX
_READ_STACKS_MAX = 16 * 2**20

CRASH_DUMP_NOTE = (
    "SGLang's crash dump (--crash-dump-folder) is a pickle of the requests of the last minutes "
    "before the crash, prompts and outputs included: user data. Readable by the service user "
    "and root only; handle and delete it as user data (docs/incidents.md)."
)

# Wall clock for names and `at`: incidents are read by people and correlated with other logs.
Clock = Callable[[], float]


@dataclass(frozen=True)
class Incident:
    """What the daemon knows about one restart, at the moment it records it."""

    reason: str
    detail: str
    launch: int
    profile: str
    exit_code: int | None = None
    signal: int | None = None
    # Unix times of the launch and how far it got: launched_at, port_open_at, ready_at,
    # stop_started_at, stopped_at; plus load phases and what the stack dump cost.
    timings: dict[str, Any] = field(default_factory=dict)
    config_path: str | None = None
    config_digest: str | None = None
    server_info: dict[str, Any] | None = None  # the last /server_info seen for this launch
    gpus: Sequence[dict[str, Any]] = ()
    log_tail: Sequence[str] = ()
    capture: Capture | None = None
    # Why no stacks were taken at all (e.g. the process had already exited): when capture is None.
    no_stacks_reason: str | None = None
    crash_dump_folder: str | None = None  # SGLang's --crash-dump-folder, when configured


@dataclass(frozen=True)
class Written:
    path: Path | None  # None: nothing could be written (error says why)
    skipped: dict[str, str] = field(default_factory=dict)
    removed: tuple[str, ...] = ()  # older incidents pruned by retention
    error: str | None = None


def digest_file(path: str | None) -> str | None:
    """sha256 of the config file as it is on disk, to tell which config a launch ran with."""
    if not path:
        return None
    try:
        return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def newest_crash_dump(folder: str | None, since: float | None = None) -> dict[str, Any] | None:
    """A pointer to the newest file under SGLang's --crash-dump-folder (it writes
    `<folder>/<hostname>/crash_dump_<time>.pkl`, tokenizer_manager.py:3436, 0.5.23)."""
    if not folder:
        return None
    newest: tuple[float, Path, int] | None = None
    with contextlib.suppress(OSError):
        for root, _dirs, files in os.walk(folder):
            for name in files:
                p = Path(root) / name
                with contextlib.suppress(OSError):
                    st = p.stat()
                    if newest is None or st.st_mtime > newest[0]:
                        newest = (st.st_mtime, p, st.st_size)
    doc: dict[str, Any] = {"folder": folder, "note": CRASH_DUMP_NOTE}
    if newest is None:
        return {**doc, "file": None}
    mtime, path, size = newest
    return {
        **doc,
        "file": str(path),
        "size_bytes": size,
        "mtime": mtime,
        "from_this_launch": since is None or mtime >= since,
    }


def _bounded_json(value: Any, limit: int) -> Any:
    text = json.dumps(value, default=str)
    if len(text) <= limit:
        return value
    return {"truncated": True, "bytes": len(text), "head": text[:limit]}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _tree_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for p in path.iterdir():
            with contextlib.suppress(OSError):
                total += p.lstat().st_size
    return total


def stamp(unix: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(unix))


class IncidentStore:
    """The incidents directory: write one, list them, read one, keep it bounded."""

    def __init__(
        self,
        cfg: IncidentsConfig,
        *,
        clock: Clock = time.time,
        free_bytes: Callable[[Path], int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.dir = Path(cfg.dir)
        self.clock = clock
        self._free = free_bytes or _free_bytes

    # ----------------------------------------------------------------- writing

    def ensure_dir(self) -> None:
        """Create the directory (0700) if needed and sweep leftovers of interrupted writes."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)
        self.sweep()

    def sweep(self) -> list[str]:
        """Remove temporary directories of writes that never finished (a crash, a kill)."""
        removed = []
        with contextlib.suppress(OSError):
            for p in self.dir.iterdir():
                if p.name.startswith(_TMP_PREFIX):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
        return removed

    def _name(self, inc: Incident, at: float) -> str:
        base = f"{stamp(at)}-{inc.reason}-launch{inc.launch}"
        name, n = base, 1
        while (self.dir / name).exists():  # same second, same launch number: another daemon run
            n += 1
            name = f"{base}-{n}"
        return name

    def write(self, inc: Incident) -> Written:
        """Write one incident. Never raises for a full or broken disk: says what happened."""
        at = self.clock()
        try:
            self.ensure_dir()
        except OSError as exc:
            return Written(None, error=f"cannot create {self.dir}: {exc.strerror or exc}")
        name = self._name(inc, at)
        files, skipped = self._plan(inc)
        doc = self._document(inc, name, at, files, skipped)
        blob = json.dumps(doc, indent=2, default=str).encode() + b"\n"
        free = self._free(self.dir)
        if free < len(blob) + 64 * 2**10:
            return Written(None, error=f"only {free} bytes free in {self.dir}: nothing written")
        tmp = self.dir / f"{_TMP_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir(mode=0o700)
            os.chmod(tmp, 0o700)  # whatever the umask
            for fname, data in files.items():
                _write_file(tmp / fname, data)
            # Last: a reader that finds incident.json finds every file it lists.
            _write_file(tmp / INCIDENT_JSON, blob)
            _fsync_dir(tmp)
            final = self.dir / name
            os.rename(tmp, final)
            _fsync_dir(self.dir)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            return Written(None, skipped, error=f"cannot write {self.dir / name}: {exc}")
        removed = self.prune(keep=name)
        return Written(final, skipped, tuple(removed))

    def _plan(self, inc: Incident) -> tuple[dict[str, bytes], dict[str, str]]:
        """The files to write, largest dropped first under the floor and the size bound."""
        files: dict[str, bytes] = {}
        tail = "\n".join(inc.log_tail) + ("\n" if inc.log_tail else "")
        data = tail.encode("utf-8", "replace")
        if len(data) > _LOG_TAIL_MAX:
            data = b"[... earlier lines cut]\n" + data[-_LOG_TAIL_MAX:]
        files[LOG_TAIL] = data
        if inc.capture is not None:
            files[STACKS] = render(inc.capture).encode("utf-8", "replace")
        elif inc.no_stacks_reason:
            files[STACKS] = f"# no stacks: {inc.no_stacks_reason}\n".encode()
        skipped: dict[str, str] = {}
        free = self._free(self.dir)
        floor = self.cfg.min_free_bytes
        for fname in sorted(files, key=lambda f: -len(files[f])):  # biggest first
            size = len(files[fname])
            left = free - sum(len(v) for v in files.values()) - _JSON_MAX
            if left < floor:
                skipped[fname] = (
                    f"not written ({size} bytes): {free} bytes free in {self.dir}; writing it "
                    f"would leave less than incidents.min_free_bytes ({floor})"
                )
                del files[fname]
            elif size > self.cfg.max_bytes // 2:
                skipped[fname] = (
                    f"not written ({size} bytes): more than half of incidents.max_bytes "
                    f"({self.cfg.max_bytes})"
                )
                del files[fname]
        return files, skipped

    def _document(
        self,
        inc: Incident,
        name: str,
        at: float,
        files: dict[str, bytes],
        skipped: dict[str, str],
    ) -> dict[str, Any]:
        if inc.capture is not None:
            stacks: dict[str, Any] = inc.capture.summary()
        else:
            stacks = {"taken": False, "reason": inc.no_stacks_reason}
        since = inc.timings.get("launched_at")
        return {
            "format": FORMAT_VERSION,
            "id": name,
            "reason": inc.reason,
            "detail": inc.detail,
            "exception": exception_line(inc.log_tail),
            "at": at,
            "at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)),
            "launch": inc.launch,
            "profile": inc.profile,
            "exit_code": inc.exit_code,
            "signal": inc.signal,
            "timings": inc.timings,
            "config": {"path": inc.config_path, "digest": inc.config_digest},
            "server_info": _bounded_json(inc.server_info, _SERVER_INFO_MAX),
            "gpus": _bounded_json(list(inc.gpus), _SERVER_INFO_MAX),
            "stacks": stacks,
            "crash_dump": newest_crash_dump(
                inc.crash_dump_folder, since if isinstance(since, int | float) else None
            ),
            "files": sorted([INCIDENT_JSON, *files]),
            "skipped": skipped,
            "kimi_serve_version": __version__,
        }

    # ----------------------------------------------------------------- retention

    def prune(self, keep: str | None = None) -> list[str]:
        """Oldest first until at most `keep` incidents and `max_bytes` remain; never `keep`."""
        entries = self.entries()  # newest first
        sizes = {p.name: _tree_bytes(p) for p in entries}
        total = sum(sizes.values())
        removed: list[str] = []
        count = len(entries)
        for p in reversed(entries):
            if count <= self.cfg.keep and total <= self.cfg.max_bytes:
                break
            if p.name == keep:
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
            count -= 1
            total -= sizes[p.name]
        return removed

    # ----------------------------------------------------------------- reading

    def entries(self) -> list[Path]:
        """Complete incident directories, newest first (hidden temporaries never count)."""
        found = []
        with contextlib.suppress(OSError):
            for p in self.dir.iterdir():
                m = _NAME.match(p.name)
                if m and (p / INCIDENT_JSON).is_file():
                    found.append((m.group(1), int(m.group(4) or 1), p))
        found.sort(key=lambda t: (t[0], t[1]), reverse=True)
        return [p for _, _, p in found]

    def load(self, path: Path) -> dict[str, Any]:
        """incident.json, or ValueError/OSError saying why not (never another exception: the
        file is the service user's to write, and root's CLI reads it)."""
        doc = untrusted.loads(read_record(path / INCIDENT_JSON, _READ_JSON_MAX))
        if not isinstance(doc, dict):
            raise ValueError("incident.json is not a JSON object")
        return doc

    def find(self, ident: str) -> Path | None:
        """An incident by its id, a unique prefix of it, or `last`."""
        entries = self.entries()
        if ident in ("last", "latest"):
            return entries[0] if entries else None
        exact = [p for p in entries if p.name == ident or str(p) == ident]
        if exact:
            return exact[0]
        prefixed = self.matching(ident)
        return prefixed[0] if len(prefixed) == 1 else None

    def matching(self, ident: str) -> list[Path]:
        """The incidents whose id starts with `ident`, newest first."""
        return [p for p in self.entries() if p.name.startswith(ident)]


def read_record(path: Path, limit: int) -> bytes:
    """A file of an incident directory as its reader may trust it: the incident directory not
    through a link, the file a regular one, not a link, not a FIFO, at most `limit` bytes."""
    with untrusted.opened_dir(path.parent) as dfd:
        return untrusted.read_file(path.name, limit, dir_fd=dfd)


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
