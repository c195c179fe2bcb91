"""The production unit, units/kimi-serve.service, installed into a test box.

The unit runs as it ships, every sandboxing setting included, with one test drop-in
on top that changes only what a box cannot provide:

- User=root: the box has no `kimi` user, and the test tree is root's.
- PrivateTmp=no and ReadWritePaths=: test files live in pytest's tmp_path under
  /tmp; a private /tmp would hide them and ProtectSystem=strict would make them
  read-only. (The box's /tmp is itself a tmpfs: nothing reaches the host's.)
- ExecStart=: the command under test, e.g. the venv's `kimi-serve run --config FILE`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from testkit.box import Box, exec_line
from testkit.paths import REPO_ROOT

UNIT_NAME = "kimi-serve.service"
UNIT_FILE = REPO_ROOT / "units" / UNIT_NAME


def dropin_text(
    box: Box,
    exec_start: Sequence[str | os.PathLike[str]],
    *,
    environment: Mapping[str, str] | None = None,
    read_write_paths: Sequence[Path] = (),
    extra: str = "",
) -> str:
    """The drop-in text described in the module docstring."""
    writable = " ".join(str(p) for p in (box.workdir, *read_write_paths))
    lines = [
        "[Service]",
        "User=root",
        "Group=root",
        "SupplementaryGroups=",
        "PrivateTmp=no",
        f"ReadWritePaths={writable}",
        *(f'Environment="{key}={value}"' for key, value in (environment or {}).items()),
        "ExecStart=",
        f"ExecStart={exec_line(*exec_start)}",
        extra,
    ]
    return "\n".join(lines) + "\n"


def install_kimi_serve(
    box: Box,
    exec_start: Sequence[str | os.PathLike[str]],
    *,
    environment: Mapping[str, str] | None = None,
    read_write_paths: Sequence[Path] = (),
    extra: str = "",
) -> None:
    """Install the shipped unit plus the test drop-in (50-test.conf); daemon-reload.

    `extra`: more drop-in lines for the [Service] section (e.g. "WatchdogSec=2s").
    """
    box.install_unit(UNIT_NAME, UNIT_FILE.read_text(), reload=False)
    dropin = dropin_text(
        box,
        exec_start,
        environment=environment,
        read_write_paths=read_write_paths,
        extra=extra,
    )
    box.install_dropin(UNIT_NAME, "50-test.conf", dropin)


# -- reading what systemd and the daemon said (for tests/systemd/test_kimi_serve_e2e.py) --

import dataclasses  # noqa: E402 (this section was appended; its imports stay with it)
import json  # noqa: E402
import re  # noqa: E402
from datetime import datetime  # noqa: E402
from typing import Any  # noqa: E402

NOTIFICATION = re.compile(
    rf"^{re.escape(UNIT_NAME)}: Got notification message from PID (\d+) \((.*)\)$", re.S
)
# Fields of one notification as systemd logs them: "A=1, STATUS=x, y" (a STATUS= text may
# itself hold ", ").
_FIELD_SPLIT = re.compile(r", (?=[A-Z_]+=)")


@dataclasses.dataclass(frozen=True)
class JournalEntry:
    """One journal entry of the unit: its text, who sent it, when journald received it."""

    message: str
    pid: int | None
    realtime: float  # unix seconds

    @property
    def from_systemd(self) -> bool:
        return self.pid == 1


@dataclasses.dataclass(frozen=True)
class Notification:
    """One sd_notify datagram, as systemd logged it at debug level (`Got notification ...`)."""

    pid: int
    fields: tuple[str, ...]
    realtime: float

    def get(self, key: str) -> str | None:
        return next((f.partition("=")[2] for f in self.fields if f.startswith(f"{key}=")), None)


def enable_debug_log(box: Box) -> None:
    """systemd logs every sd_notify message it accepts (and its state changes) at debug."""
    box.systemctl("log-level", "debug", check=True)


def journal_entries(box: Box, unit: str = UNIT_NAME) -> list[JournalEntry]:
    """The unit's journal, in journald's order, systemd's own lines about it included.

    Matched by unit *and* by the daemon's syslog identifier: at systemd's debug level the
    forked child logs before it joins the unit's cgroup, journald caches the PID's cgroup
    (init.scope) for a second, and `journalctl -u` would miss the daemon's first lines.
    """
    identifier = unit.removesuffix(".service")
    done = box.run(
        "journalctl", "--no-pager", "--quiet", "-o", "json",
        f"_SYSTEMD_UNIT={unit}", "+", f"UNIT={unit}", "+", f"SYSLOG_IDENTIFIER={identifier}",
        check=True,
    )  # fmt: skip
    entries = []
    for line in done.stdout.splitlines():
        doc = json.loads(line)
        message = doc.get("MESSAGE", "")
        if isinstance(message, list):  # journald's form for text that is not clean UTF-8
            message = bytes(message).decode("utf-8", "replace")
        pid = doc.get("_PID")
        entries.append(
            JournalEntry(
                str(message), int(pid) if pid else None, int(doc["__REALTIME_TIMESTAMP"]) / 1e6
            )
        )
    return entries


def notifications(entries: Sequence[JournalEntry]) -> list[Notification]:
    """The notifications systemd accepted, oldest first (needs enable_debug_log)."""
    found = []
    for entry in entries:
        match = NOTIFICATION.match(entry.message) if entry.from_systemd else None
        if match:
            fields = tuple(_FIELD_SPLIT.split(match.group(2)))
            found.append(Notification(int(match.group(1)), fields, entry.realtime))
    return found


def daemon_events(entries: Sequence[JournalEntry]) -> list[dict[str, Any]]:
    """The daemon's own JSON log lines (logging.format json), each with `_at` (unix s) added.

    `_at` is the daemon's timestamp, taken before the line was written.
    """
    events = []
    for entry in entries:
        if entry.from_systemd or not entry.message.startswith("{"):
            continue
        try:
            doc = json.loads(entry.message)
        except ValueError:
            continue
        if isinstance(doc, dict) and "event" in doc and "timestamp" in doc:
            doc["_at"] = datetime.fromisoformat(doc["timestamp"]).timestamp()
            events.append(doc)
    return events


def box_processes(box: Box) -> dict[int, tuple[int, int]]:
    """Every process in the box: PID -> (parent PID, start time in clock ticks since boot).

    A (PID, start time) pair names one process even if its PID is reused later.
    """
    done = box.run(box.python, "-c", _PROCESSES, check=True)
    return {int(pid): (int(ppid), int(start)) for pid, ppid, start in json.loads(done.stdout)}


def descendants(processes: Mapping[int, tuple[int, int]], root: int) -> set[int]:
    """`root` and every process below it."""
    tree = {root}
    grew = True
    while grew:
        below = {pid for pid, (ppid, _) in processes.items() if ppid in tree} - tree
        tree |= below
        grew = bool(below)
    return tree & (set(processes) | {root})


_PROCESSES = """
import json, os
found = []
for name in os.listdir("/proc"):
    if not name.isdigit():
        continue
    try:
        with open(f"/proc/{name}/stat") as f:
            stat = f.read()
    except OSError:
        continue
    fields = stat.rpartition(")")[2].split()  # after the comm, which may hold spaces
    found.append((int(name), int(fields[1]), int(fields[19])))
print(json.dumps(found))
"""
