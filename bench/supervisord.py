"""The supervisord baseline: supervisord 4.3 (PyPI `supervisor`) running the stand-in.

supervisord calls a program RUNNING once it has stayed up `startsecs` (1 s by default) and
restarts it when it exits (`autorestart`). Its own log (millisecond timestamps) says when it
noticed an exit, respawned, and called the program RUNNING.

It lives in a virtualenv of its own, bench/.supervisord-venv, built on first use: the PyPI
package's top-level module is also named `supervisor`, so installed into the project's venv
it would shadow kimi-serve's package for every process started outside the repository.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from bench.common import REPO_ROOT, BenchError, Lines, Procs

VERSION = "4.3.0"
VENV = REPO_ROOT / "bench" / ".supervisord-venv"
STAMP = VENV / ".bench-stamp"
PROGRAM = "sglang"

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (\w+) (.*)$")


class Unavailable(Exception):
    """supervisord cannot be provided here; the message says why."""


def ensure() -> Path:
    """Path of the supervisord executable, building its venv if needed (needs the package
    index once)."""
    exe = VENV / "bin" / "supervisord"
    if STAMP.exists() and STAMP.read_text().strip() == VERSION and exe.exists():
        return exe
    base = Path(sys.base_prefix) / "bin" / "python3"
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    try:
        for argv, timeout in (
            ([str(base), "-m", "venv", "--clear", str(VENV)], 120),
            ([*pip, "--disable-pip-version-check", f"supervisor=={VERSION}"], 300),
        ):
            subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise Unavailable(
            f"cannot install supervisor=={VERSION} into {VENV}: {detail.strip()[-300:]}"
        ) from None
    STAMP.write_text(VERSION + "\n")
    return exe


def _follow(path: Path, stop: threading.Event) -> Iterator[str]:
    """The lines of a file as they are written to it, until `stop`."""
    while not path.exists():
        if stop.wait(0.005):
            return
    partial = ""
    with path.open() as f:
        while not stop.is_set():
            chunk = f.read()
            if not chunk:
                time.sleep(0.005)
                continue
            partial += chunk
            *complete, partial = partial.split("\n")
            yield from (line + "\n" for line in complete)


def _parse(line: str) -> tuple[float, str] | None:
    """A line of supervisord's log: (unix time it was logged, text)."""
    m = _LINE.match(line.rstrip("\n"))
    if not m:
        return None
    # supervisord stamps local time with milliseconds.
    t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
    return t, f"{m.group(3)} {m.group(4)}"


def _env_value(value: str) -> str:
    if '"' in value or "%" in value:
        raise ValueError(f"cannot pass {value!r} through supervisord's environment=")
    return f'"{value}"'


class Supervisord:
    def __init__(
        self,
        procs: Procs,
        work: Path,
        argv: Sequence[str],
        env: Mapping[str, str],
    ) -> None:
        self.procs = procs
        self.work = work
        self.work.mkdir(parents=True, exist_ok=True)
        self.exe = ensure()
        self.log_path = work / "supervisord.log"
        self.child_log = work / f"{PROGRAM}.log"
        environment = ",".join(f"{k}={_env_value(v)}" for k, v in env.items())
        command = " ".join(shlex.quote(a) for a in argv)
        if "%" in command:
            raise ValueError("supervisord would expand % in the command line")
        (work / "supervisord.conf").write_text(f"""\
[supervisord]
nodaemon=true
logfile={self.log_path}
pidfile={work / "supervisord.pid"}
childlogdir={work}
loglevel=info

[unix_http_server]
file={work / "supervisor.sock"}

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[program:{PROGRAM}]
command={command}
directory={REPO_ROOT}
environment={environment}
autostart=true
autorestart=true
startsecs=1
startretries=3
stopasgroup=true
killasgroup=true
stopwaitsecs=3
redirect_stderr=true
stdout_logfile={self.child_log}
""")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Lines | None = None  # events: (unix time logged, text)
        self._stop = threading.Event()

    def start(self) -> Supervisord:
        # No PYTHONPATH: the repository's `supervisor` package would shadow supervisord's own.
        self.proc = self.procs.start(
            [self.exe, "-c", self.work / "supervisord.conf"],
            env={"PYTHONPATH": ""},
            stdout=subprocess.DEVNULL,
            stderr=(self.work / "supervisord.stderr").open("wb"),
        )
        self.log = Lines(_follow(self.log_path, self._stop), parse=_parse)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait(self, pattern: str, timeout: float, start: int = 0) -> tuple[int, float, str]:
        """(index, time, text) of the first log line from `start` on matching `pattern`."""
        assert self.log is not None
        rx = re.compile(pattern)
        i, (t, text) = self.log.wait(lambda e: rx.search(e[1]) is not None, timeout, start)
        return i, t, text

    def child_pid(self) -> int:
        assert self.log is not None
        spawned = [t for _, t in self.log.events if f"spawned: '{PROGRAM}' with pid" in t]
        if not spawned:
            raise BenchError("supervisord has not spawned the program")
        return int(spawned[-1].rsplit(" ", 1)[1])

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc, timeout=20)
        self._stop.set()


# The log lines, as supervisord 4.3 writes them.
SPAWNED = rf"spawned: '{PROGRAM}' with pid"
RUNNING = rf"success: {PROGRAM} entered RUNNING state"
EXITED = rf"exited: {PROGRAM} "
