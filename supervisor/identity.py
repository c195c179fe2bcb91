"""Process identity: (pid, create time), so a reused PID is never signalled by mistake.

Also the launch record kept under the state directory: what this daemon launched, so a daemon
that was itself SIGKILLed can find and remove its previous launch's processes on the next start
(outside systemd there is no cgroup to do it: Kubernetes, a terminal).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

RECORD_FILE = "launch.json"
# Every process we launch carries this variable (inherited by SGLang's children). Its value is
# the daemon's state directory, so two daemons on one host never touch each other's processes.
OWNER_ENV = "KIMI_SERVE_OWNER"
# psutil's create_time comes from /proc/<pid>/stat in clock ticks since boot; two reads of the
# same process agree far better than this. The one tolerance of the project.
CREATE_TIME_SLACK = 0.05


def same_start(recorded: float | None, actual: float) -> bool:
    """Whether two create times name the same process."""
    return recorded is not None and abs(recorded - actual) < CREATE_TIME_SLACK


@dataclass(frozen=True, order=True)
class ProcessIdentity:
    pid: int
    create_time: float

    def matches(self, proc: psutil.Process) -> bool:
        try:
            return same_start(self.create_time, proc.create_time())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False


def owner_marker(state_dir: str) -> str:
    """The OWNER_ENV value of a daemon's launches: its state directory, resolved."""
    return str(Path(state_dir).resolve())


def identity_of(pid: int) -> ProcessIdentity | None:
    try:
        return ProcessIdentity(pid, psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def live_process(ident: ProcessIdentity) -> psutil.Process | None:
    """The process if it is still the same one (and not a zombie), else None."""
    try:
        proc = psutil.Process(ident.pid)
        if not ident.matches(proc):
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def signal_identity(ident: ProcessIdentity, sig: signal.Signals) -> bool:
    """Send `sig` only if the pid still belongs to the same process. True if sent."""
    proc = live_process(ident)
    if proc is None:
        return False
    try:
        proc.send_signal(sig)
        return True
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def descendants(pid: int) -> list[ProcessIdentity]:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    out = []
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            out.append(ProcessIdentity(child.pid, child.create_time()))
    return out


def launch_leader(processes: Iterable[ProcessIdentity]) -> ProcessIdentity | None:
    """The SGLang main process of a recorded launch: the first one created.

    It is started in a session of its own (`start_new_session`), so its pid is the session id
    and the process group id of every process of the launch; every other one is its descendant,
    created after it.
    """
    return min(processes, key=lambda i: (i.create_time, i.pid), default=None)


def leader_still_names_session(leader: ProcessIdentity) -> bool:
    """Whether a session (or group) with id `leader.pid` can still be the launch's.

    True while the leader is alive and is the recorded process, and once it is gone altogether:
    Linux does not hand out a pid that still names a session or process group, so members left
    behind keep it ours. False when the pid now names another process (it was reused after the
    whole session was gone).
    """
    try:
        proc = psutil.Process(leader.pid)
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False
    return leader.matches(proc)


def session_members(leader: ProcessIdentity) -> list[ProcessIdentity]:
    """Live processes in the session or process group of a launch's main process.

    Evidence of ownership that needs no environment marker: setproctitle in SGLang's
    schedulers and detokenizer wipes /proc/PID/environ unless SPT_NOENV=1 (docs/sglang.md).
    """
    if not leader_still_names_session(leader):
        return []
    found = []
    for proc in psutil.process_iter(["pid"]):
        pid = proc.pid
        if pid == os.getpid():
            continue
        try:
            if leader.pid not in (os.getsid(pid), os.getpgid(pid)):
                continue
            with proc.oneshot():
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                created = proc.create_time()
        except (OSError, psutil.Error):
            continue
        # A member is created after its session's leader.
        if created + CREATE_TIME_SLACK >= leader.create_time:
            found.append(ProcessIdentity(pid, created))
    return found


@dataclass(frozen=True)
class LaunchRecord:
    """What one daemon launched: the SGLang main process and every descendant seen."""

    daemon_pid: int
    profile: str
    processes: tuple[ProcessIdentity, ...]

    @property
    def leader(self) -> ProcessIdentity | None:
        """The launch's main process (session leader); see launch_leader()."""
        return launch_leader(self.processes)

    def to_json(self) -> str:
        return json.dumps(
            {
                "daemon_pid": self.daemon_pid,
                "profile": self.profile,
                "processes": [asdict(p) for p in self.processes],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> LaunchRecord:
        data = json.loads(text)
        return cls(
            daemon_pid=int(data["daemon_pid"]),
            profile=str(data["profile"]),
            processes=tuple(
                ProcessIdentity(int(p["pid"]), float(p["create_time"])) for p in data["processes"]
            ),
        )


class RecordStore:
    """The launch record on disk, written atomically (rename) so a crash never leaves half."""

    def __init__(self, state_dir: str) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / RECORD_FILE

    def check_writable(self) -> None:
        """Raises OSError with a readable message when the state dir cannot be used."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.dir, prefix=".probe-", delete=True):
            pass

    def load(self) -> LaunchRecord | None:
        try:
            return LaunchRecord.from_json(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            # A torn or foreign file: nothing in it can be trusted to name our processes.
            return None

    def save(self, record: LaunchRecord) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".launch-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(record.to_json())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
