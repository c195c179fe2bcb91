"""The daemon's stack-dump path in miniature, run as the shipped unit's ExecStart in a box.

Does what the daemon does before killing a hung SGLang: `stacks.confine()` first, then starts
the "SGLang" processes (two Python processes hung in a named function; one made non-dumpable,
which only CAP_SYS_PTRACE can trace, as Yama's ptrace_scope=1 makes a sibling), captures their
stacks with the real py-spy, writes an incident into the unit's state directory, and records
what it saw (capabilities of itself and of its children, each dump's verdict) in
$STATE_DIRECTORY/result.json. Then READY=1, and it waits to be stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import sdnotify

from supervisor.config import IncidentsConfig
from supervisor.incidents import Incident, IncidentStore, stacks

TARGET = """
import ctypes, os, sys, threading
if sys.argv[1] == "nondumpable":
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
def wedged_in_all_reduce():
    print(os.getpid(), flush=True)
    threading.Event().wait()
wedged_in_all_reduce()
"""


def caps(pid: int | str) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("CapPrm", "CapEff", "CapAmb", "CapInh", "CapBnd"):
            out[key] = int(value.strip(), 16)
    return out


async def main() -> None:
    state = Path(os.environ["STATE_DIRECTORY"])
    stacks.confine()
    kinds = ("dumpable", "nondumpable")
    procs = [
        subprocess.Popen([sys.executable, "-c", TARGET, k], stdout=subprocess.PIPE, text=True)
        for k in kinds
    ]
    for p in procs:
        assert p.stdout is not None and int(p.stdout.readline()) == p.pid
    cap = await stacks.capture([p.pid for p in procs], timeout=10.0)
    store = IncidentStore(IncidentsConfig(str(state / "incidents"), 20, 10.0, 2**28, 0))
    written = store.write(
        Incident(reason="liveness_failed", detail="box", launch=1, profile="primary", capture=cap)
    )
    result = {
        "daemon": caps("self"),
        "targets": {k: caps(p.pid) for k, p in zip(kinds, procs, strict=True)},
        "stacks": {
            k: {"error": s.error, "frame": "wedged_in_all_reduce" in s.text, "text": s.text}
            for k, s in zip(kinds, cap.stacks, strict=True)
        },
        "reason": cap.reason,
        "incident": str(written.path) if written.path else None,
        "incident_error": written.error,
        "incident_mode": oct(written.path.stat().st_mode & 0o777) if written.path else None,
        "incident_uid": written.path.stat().st_uid if written.path else None,
        "uid": os.getuid(),
    }
    for p in procs:
        p.kill()
        p.wait()
    (state / "result.json").write_text(json.dumps(result))
    notifier = sdnotify.SystemdNotifier()
    notifier.notify("READY=1\nSTATUS=stacks taken")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    while not stop.is_set():
        notifier.notify("WATCHDOG=1")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 5.0)


if __name__ == "__main__":
    asyncio.run(main())
