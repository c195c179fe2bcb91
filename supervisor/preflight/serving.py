"""Is the process that holds SGLang's port this host's own supervised SGLang?

`kimi-serve preflight` on a serving host finds `sglang.port` bound. That is no obstacle when the
holder is the running daemon's own SGLang: a restart stops it before the next launch binds the
port. It is one when anything else holds it (a leftover SGLang of a dead daemon, another
program): that launch would fail after the whole model has loaded.

Who is "the running daemon" is asked of the daemon itself: `GET /status` on `admin.listen` with
the admin token, through the admin client, which on a loopback address sends it only to a
socket of root or the service user (admin/client.py). Its `daemon_process` names its main PID and
that process's start time. The holder counts as ours only if it descends from that PID and the
ancestor with that PID started at that time (a PID reused since is another process). Nothing is
taken from a file the service user, and so SGLang, can write (the launch record, the owner
marker): a compromised SGLang could claim any process there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psutil

from supervisor import secret_files
from supervisor.admin import client as adminclient
from supervisor.config import Config
from supervisor.preflight.result import HOST, Check

# psutil computes both start times from the same /proc fields; a margin for float rounding.
START_TIME_SLACK_S = 0.05


@dataclass(frozen=True)
class Daemon:
    """The running daemon as its authenticated /status tells it."""

    pid: int
    create_time: float
    state: str
    child_pid: int | None
    launch: int | None


def listeners(port: int) -> list[int | None]:
    """The PIDs listening on TCP `port` (None for a socket whose process this user cannot see)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return [None]
    return sorted(
        {
            c.pid
            for c in conns
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
        },
        key=lambda p: -1 if p is None else p,
    )


def ask_daemon(cfg: Config) -> Daemon | str:
    """The daemon behind `admin.listen`, or why it cannot be known."""
    path = cfg.admin.token_file
    try:
        token = secret_files.read_for_client(path)
    except secret_files.TokenFileError as exc:
        return f"cannot ask the daemon without its admin token: {exc.message}"
    base = f"http://{cfg.admin.listen}"
    try:
        answer = adminclient.request(
            "GET", base, "/status", trusted=secret_files.service_uids(path), token=token
        )
        doc = answer.json() if answer.status == 200 else None
    except (adminclient.NotTheService, adminclient.Unreachable) as exc:
        return f"no kimi-serve answers at {base} ({exc})"
    except ValueError as exc:
        return f"the answer of {base}/status is not JSON ({exc})"
    if doc is None:
        return f"{base}/status answered HTTP {answer.status} {answer.reason} to the admin token"
    return (
        _daemon(doc) or f"{base}/status does not name the daemon's process (an older kimi-serve?)"
    )


def _daemon(doc: Any) -> Daemon | None:
    if not isinstance(doc, dict):
        return None
    proc, child = doc.get("daemon_process"), doc.get("child")
    if not isinstance(proc, dict):
        return None
    pid, started = proc.get("pid"), proc.get("create_time")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(started, int | float):
        return None
    child = child if isinstance(child, dict) else {}
    child_pid, launch = child.get("pid"), child.get("launch")
    return Daemon(
        pid,
        float(started),
        str(doc.get("state", "?"))[:40],
        child_pid if isinstance(child_pid, int) else None,
        launch if isinstance(launch, int) else None,
    )


def descends(pid: int, daemon: Daemon) -> bool:
    """`pid` is a descendant of the daemon's main process (PID and start time both match)."""
    try:
        for parent in psutil.Process(pid).parents():
            if parent.pid == daemon.pid:
                return abs(parent.create_time() - daemon.create_time) <= START_TIME_SLACK_S
    except psutil.Error:
        return False
    return False


def recognise(cfg: Config, port: int) -> Check | str:
    """The `port` check for a port in use: passed when its holders are all the running
    daemon's own SGLang; else why they are not known to be (added to the failure's hint)."""
    holders = listeners(port)
    if not holders or None in holders:
        return "the port's holder is not visible to this user: run preflight as root"
    daemon = ask_daemon(cfg)
    if isinstance(daemon, str):
        return daemon
    pids = [p for p in holders if p is not None]
    foreign = [p for p in pids if not descends(p, daemon)]
    if foreign:
        return (
            f"pid {', '.join(map(str, foreign))} is not a process of the running kimi-serve "
            f"(pid {daemon.pid}, state {daemon.state})"
        )
    launch = f", launch {daemon.launch}" if daemon.launch is not None else ""
    return Check(
        "port",
        True,
        HOST,
        f"{cfg.sglang.host}:{port} is served by kimi-serve's own SGLang (pid "
        f"{', '.join(map(str, pids))}{launch}; daemon pid {daemon.pid}, state {daemon.state})",
        "the host is serving: a restart stops this SGLang before the next launch binds the port",
        serving=True,
    )
