"""Process identity: (pid, create time), so a reused PID is never signalled by mistake.

Also the launch record kept under the state directory: what this daemon launched, so a daemon
that was itself SIGKILLed can find and remove its previous launch's processes on the next start
(outside systemd there is no cgroup to do it: Kubernetes, a terminal).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from supervisor import untrusted

RECORD_FILE = "launch.json"
# Every process we launch carries this variable (inherited by SGLang's children). Its value is
# the daemon's state directory, so two daemons on one host never touch each other's processes.
OWNER_ENV = "KIMI_SERVE_OWNER"
# psutil's create_time comes from /proc/<pid>/stat in clock ticks since boot; two reads of the
# same process agree far better than this. The one tolerance of the project.
CREATE_TIME_SLACK = 0.05
# Changes at every boot. A record from another boot names pids that were handed out afresh since:
# none of them can be ours, and the session of a dead leader may be anyone's now.
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def current_boot_id(path: str = BOOT_ID_FILE) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def real_uid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).uids().real
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


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


def session_members(leader: ProcessIdentity, uid: int | None = None) -> list[ProcessIdentity]:
    """Live processes of `uid` (default: ours) in the session or process group of a launch's
    main process.

    Evidence of ownership that needs no environment marker: setproctitle in SGLang's
    schedulers and detokenizer wipes /proc/PID/environ unless SPT_NOENV=1 (docs/sglang.md).
    Only the launch's user counts: every process of a launch runs as the daemon's user, and a
    session of a dead leader named in a forged record may be another user's.
    """
    if not leader_still_names_session(leader):
        return []
    want = os.getuid() if uid is None else uid
    found = []
    for proc in psutil.process_iter(["pid"]):
        pid = proc.pid
        if pid == os.getpid():
            continue
        try:
            if leader.pid not in (os.getsid(pid), os.getpgid(pid)):
                continue
            with proc.oneshot():
                if proc.status() == psutil.STATUS_ZOMBIE or proc.uids().real != want:
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
    """What one daemon launched: the SGLang main process and every descendant seen, and the
    boot it happened in."""

    daemon_pid: int
    profile: str
    processes: tuple[ProcessIdentity, ...]
    boot_id: str | None = field(default_factory=current_boot_id)

    @property
    def leader(self) -> ProcessIdentity | None:
        """The launch's main process (session leader); see launch_leader()."""
        return launch_leader(self.processes)

    def to_json(self) -> str:
        return json.dumps(
            {
                "daemon_pid": self.daemon_pid,
                "profile": self.profile,
                "boot_id": self.boot_id,
                "processes": [asdict(p) for p in self.processes],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> LaunchRecord:
        # The service user's file, read by root too (gpu-clean): no NaN, no integer of
        # hundreds of digits (float() of it raises OverflowError), no deep nesting.
        data = untrusted.loads(text)
        boot = data.get("boot_id")
        return cls(
            daemon_pid=int(data["daemon_pid"]),
            profile=str(data["profile"]),
            processes=tuple(
                ProcessIdentity(int(p["pid"]), float(p["create_time"])) for p in data["processes"]
            ),
            boot_id=None if boot is None else str(boot),
        )


@dataclass(frozen=True)
class RecordRead:
    """A launch record as far as it can be trusted: `record` is None when nothing in the file
    may name our processes; `warnings` say what was ignored and why (one line each)."""

    record: LaunchRecord | None
    warnings: tuple[str, ...] = ()

    @property
    def processes(self) -> set[ProcessIdentity]:
        return set(self.record.processes) if self.record else set()


# The file is written by the service user, whose SGLang runs model code: root's `gpu-clean` and
# a daemon running as root must not take it on trust (docs/security.md, "Launch records").
MAX_RECORD_BYTES = 1 << 20


class RecordStore:
    """The launch record on disk, written atomically (rename) so a crash never leaves half."""

    def __init__(self, state_dir: str) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / RECORD_FILE

    def check_writable(self) -> None:
        """Raises OSError with a readable message when the state dir cannot be used."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.dir, prefix=".probe-", delete=True):
            pass

    def load(self, uid: int | None = None) -> LaunchRecord | None:
        return self.read(uid).record

    def read(self, uid: int | None = None, boot_id: str | None = None) -> RecordRead:
        """The record, bound to its owner, mode and boot.

        `uid` (default: ours) is the service user's: the file must be a regular file of that
        user that group and others cannot write, opened without following a link, written in
        this boot (`boot_id`, default: the running one). A listed process that runs as another
        user is dropped: it cannot be one of ours, whatever the file says.
        """
        want = os.getuid() if uid is None else uid
        boot = current_boot_id() if boot_id is None else boot_id
        where = str(self.path)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return RecordRead(None)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return RecordRead(None, (f"{where} is a symbolic link: ignored",))
            return RecordRead(None, (f"cannot read {where}: {exc.strerror or exc}: ignored",))
        try:
            st = os.fstat(fd)
            problem = _unsafe(st, want)
            if problem:
                return RecordRead(None, (f"{where} {problem}: ignored",))
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_RECORD_BYTES + 1)
        except OSError as exc:
            return RecordRead(None, (f"cannot read {where}: {exc.strerror or exc}: ignored",))
        finally:
            os.close(fd)
        try:
            if len(raw) > MAX_RECORD_BYTES:
                raise ValueError("too large")
            record = LaunchRecord.from_json(raw.decode())
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError):
            # A torn or foreign file: nothing in it can be trusted to name our processes.
            return RecordRead(None, (f"{where} is not a launch record: ignored",))
        if record.boot_id is None or record.boot_id != boot:
            was = record.boot_id or "none"
            return RecordRead(
                None,
                (
                    f"{where} was written in another boot (boot id {was}, now {boot}): "
                    "its processes are not ours; ignored",
                ),
            )
        kept, notes = [], []
        for ident in record.processes:
            who = real_uid(ident.pid) if live_process(ident) is not None else None
            if who is not None and who != want:
                notes.append(
                    f"{where} lists pid {ident.pid}, which runs as uid {who}, not the service "
                    f"user's uid {want}: not ours, ignored"
                )
                continue
            kept.append(ident)
        trusted = LaunchRecord(record.daemon_pid, record.profile, tuple(kept), record.boot_id)
        return RecordRead(trusted, tuple(notes))

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


def _unsafe(st: os.stat_result, uid: int) -> str:
    """Why a record file with this stat cannot be trusted; "" when it can."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not the service user's uid {uid}"
    if st.st_mode & 0o022:
        mode = stat.S_IMODE(st.st_mode)
        return f"is mode {mode:04o}: group or others may write it"
    return ""
