"""A real systemd 252, booted as PID 1 of private namespaces, for tests.

The host's PID 1 is not systemd, yet `systemctl start` of a `Type=notify` unit must
block until READY=1 exactly as on a server. So a test boots its own systemd:

    box = Box(tmp_path / "box").start()
    box.install_unit("demo.service", "[Service]\\nExecStart=/bin/sleep infinity\\n")
    box.systemctl("start", "demo.service", check=True)
    box.stop()

The box shares the host's filesystems, and a systemd that runs the distribution's
boot jobs acts on the host (one such box emptied /tmp). The containment below follows
the project's design note on systemd in a namespace step by step; `_INIT_SCRIPT` is
where it happens and docs/systemd.md ("The test box") explains each step. On top of
the note's list the box also gets a private /dev, /sys and read-only /proc/sys, and
tmpfs over /tmp, /var/tmp, /var/lib, /var/cache and /var/log, so that a unit under
test (PrivateTmp=, StateDirectory=, a tmpfiles run, a sysctl) cannot reach the host
either.
Paths a test needs (its work directory, the repository, the interpreter) are bound
back in at the same place.

Processes in the box see only its loopback; a test reaches a server inside with
`box.run(...)` or `box.http_get(url)`, which run in all of the box's namespaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from testkit.paths import REPO_ROOT
from testkit.wait import poll

T = TypeVar("T")

SYSTEMD = Path("/lib/systemd/systemd")
JOURNALD = Path("/lib/systemd/systemd-journald")

BOOT_TARGET = "kimi-box.target"

# Every target that default dependencies (of services, sockets, mounts, slices and the
# distribution's units) name. Empty stubs: starting one starts nothing else.
STUB_TARGETS = (
    "sysinit", "basic", "sockets", "paths", "timers", "slices",
    "local-fs", "local-fs-pre", "remote-fs", "remote-fs-pre", "swap", "cryptsetup",
    "network", "network-pre", "network-online", "nss-lookup", "nss-user-lookup",
    "time-sync", "time-set", "getty", "multi-user", "default", "graphical",
    "shutdown", "umount", "final", "emergency", "rescue",
)  # fmt: skip

# Host directories covered by a tmpfs inside the box. /etc/systemd/system and
# /var/log/journal are the design note's; the others keep units under test
# (PrivateTmp=, StateDirectory=, LogsDirectory=, CacheDirectory=) off the host.
MASKED_DIRS = (
    "/etc/systemd", "/etc/systemd/system", "/var/log/journal",
    "/tmp", "/var/tmp", "/var/lib", "/var/cache", "/var/log",
)  # fmt: skip

# /tmp is shared with everything else on the host, and other programs remove their own
# entries while a box runs (pip removes its build directories after minutes). So only
# entries older than this count when they vanish: a boot-time tmpfiles run or a wipe
# takes those too, and the harness's own 30-day-old sentinel with them.
TMP_SETTLE_SECONDS = 3600.0

JOURNALD_CONF = """\
[Journal]
Storage=volatile
RuntimeMaxUse=64M
RateLimitIntervalSec=0
ReadKMsg=no
ForwardToSyslog=no
ForwardToKMsg=no
ForwardToConsole=no
ForwardToWall=no
"""

# The host's core_pattern is global and usually a plain file name: a unit under test
# killed by SIGABRT (the watchdog's signal) would write a core file into the host's /.
SYSTEM_CONF = """\
[Manager]
DefaultLimitCORE=0
"""

JOURNALD_SOCKET = """\
[Unit]
Description=Journal socket (kimi-box: volatile, in the box's /run)
DefaultDependencies=no
Before=sockets.target

[Socket]
ListenStream=/run/systemd/journal/stdout
ListenDatagram=/run/systemd/journal/socket
SocketMode=0666
PassCredentials=yes
PassSecurity=yes
ReceiveBuffer=8M
Service=systemd-journald.service
"""

JOURNALD_SERVICE = f"""\
[Unit]
Description=Journal service (kimi-box: volatile, in the box's /run)
DefaultDependencies=no
Requires=systemd-journald.socket
After=systemd-journald.socket

[Service]
Type=notify
Sockets=systemd-journald.socket
ExecStart={JOURNALD}
Restart=always
RestartSec=0
StandardOutput=null
FileDescriptorStoreMax=4224
"""

BOOT_TARGET_TEXT = """\
[Unit]
Description=kimi-box boot target: the journal and nothing else
DefaultDependencies=no
Wants=systemd-journald.socket systemd-journald.service
After=systemd-journald.socket systemd-journald.service
AllowIsolate=yes
"""

# Runs inside the fresh namespaces as their PID 1, then becomes systemd. Positional
# parameters: see Box._init_argv. Mount order matters: /run first (staging area for
# bind mounts), then the paths to keep are set aside, then the host's directories are
# masked, then the kept paths return at their old place.
_INIT_SCRIPT = r"""
set -euf  # -f: no globbing of the unquoted path lists below
workdir=$1 keep=$2 devices=$3
shift 3   # the rest: systemd's argv, preceded by its environment as NAME=VALUE

mount --make-rprivate /
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
mkdir -p /run/systemd/journald.conf.d
cp "$workdir/journald.conf" /run/systemd/journald.conf.d/kimi-box.conf

stage=/run/kimi-box-stage
mkdir "$stage"
i=0
for p in $keep; do
    mkdir "$stage/$i"; mount --rbind "$p" "$stage/$i"; i=$((i + 1))
done
i=0
for d in $devices; do
    touch "$stage/dev$i"; mount --bind "$d" "$stage/dev$i"; i=$((i + 1))
done

if [ -d /var/log/journal ]; then mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /var/log/journal; fi
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /etc/systemd
mkdir /etc/systemd/system /etc/systemd/system.conf.d
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /etc/systemd/system
cp "$workdir/system.conf" /etc/systemd/system.conf.d/kimi-box.conf
for m in /tmp /var/tmp; do mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$m"; done
for m in /var/lib /var/cache /var/log; do mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$m"; done
i=0
for p in $keep; do
    mkdir -p "$p"; mount --move "$stage/$i" "$p"; rmdir "$stage/$i"; i=$((i + 1))
done

# A private /dev: what systemd creates there (fd, stdin, ... links; units' shm
# segments) stays in the box, and /dev/kmsg is absent, so nothing of the box reaches
# the host's kernel log.
mount -t tmpfs -o mode=0755,nosuid,size=16m tmpfs /dev
mknod -m 666 /dev/null c 1 3; mknod -m 666 /dev/zero c 1 5; mknod -m 666 /dev/full c 1 7
mknod -m 666 /dev/random c 1 8; mknod -m 666 /dev/urandom c 1 9; mknod -m 666 /dev/tty c 5 0
mkdir /dev/pts /dev/shm /dev/mqueue
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,nosuid,noexec devpts /dev/pts
ln -s pts/ptmx /dev/ptmx
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
mount -t mqueue -o nosuid,nodev,noexec mqueue /dev/mqueue
ln -s /proc/self/fd /dev/fd; ln -s /proc/self/fd/0 /dev/stdin
ln -s /proc/self/fd/1 /dev/stdout; ln -s /proc/self/fd/2 /dev/stderr
touch /dev/console; mount --bind "$workdir/console" /dev/console
i=0
for d in $devices; do
    mkdir -p "$(dirname "$d")"; touch "$d"; mount --move "$stage/dev$i" "$d"
    rm "$stage/dev$i"; i=$((i + 1))
done
rmdir "$stage"  # never rm -r: a bind mount left here would lead into the host

# sysfs of this network namespace, read-only; under it the cgroup2 file system of
# this cgroup namespace, whose root is the box's own subtree on the host.
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mount -o remount,bind,ro,nosuid,nodev,noexec /sys
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup

# Kernel tunables are global: read-only, except the network namespace's own.
mount --bind /proc/sys /proc/sys
mount --bind /proc/sys/net /proc/sys/net
mount -o remount,bind,ro /proc/sys
if [ -e /proc/sysrq-trigger ]; then
    mount --bind /proc/sysrq-trigger /proc/sysrq-trigger
    mount -o remount,bind,ro /proc/sysrq-trigger
fi

ip link set lo up
exec env -i "$@"
"""


class BoxUnavailable(Exception):
    """This host cannot boot a box (not root, no unshare, no cgroup2): skip, saying why."""


class BoxError(RuntimeError):
    """The box failed to boot or died; the message carries its console and launcher log."""


@dataclasses.dataclass(frozen=True)
class HttpResult:
    """One GET made from inside the box. `status` is None when no response came."""

    status: int | None
    body: str
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class HostSnapshot:
    """Top-level listings of /tmp and /dev (name -> ctime), to prove a box left them alone.

    /dev is compared exactly. In /tmp the loss of an entry older than
    TMP_SETTLE_SECONDS counts, and so does anything a sandboxed unit would have created
    there (systemd-private-*); see TMP_SETTLE_SECONDS for why not every entry.
    """

    taken_at: float
    tmp: Mapping[str, float]
    dev: Mapping[str, float]

    @classmethod
    def take(cls, tmp: Path = Path("/tmp"), dev: Path = Path("/dev")) -> HostSnapshot:
        return cls(time.time(), _listing(tmp), _listing(dev))

    def changes_since(self, before: HostSnapshot) -> list[str]:
        changes = [f"/dev/{n} appeared" for n in sorted(self.dev.keys() - before.dev.keys())]
        changes += [f"/dev/{n} vanished" for n in sorted(before.dev.keys() - self.dev.keys())]
        settled = before.taken_at - TMP_SETTLE_SECONDS
        changes += [
            f"/tmp/{n} vanished"
            for n in sorted(before.tmp.keys() - self.tmp.keys())
            if before.tmp[n] < settled
        ]
        changes += [
            f"/tmp/{n} appeared"
            for n in sorted(self.tmp.keys() - before.tmp.keys())
            if n.startswith("systemd-private-")
        ]
        return changes


def _listing(directory: Path) -> dict[str, float]:
    listing = {}
    for entry in os.scandir(directory):
        with contextlib.suppress(FileNotFoundError):
            listing[entry.name] = entry.stat(follow_symlinks=False).st_ctime
    return listing


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "",
) -> T:
    """Poll `predicate` until it returns something truthy; return that value.

    Raises TimeoutError naming `what` and the last value seen.
    """
    came, value = poll(predicate, timeout, interval)
    if not came:
        raise TimeoutError(
            f"{what or getattr(predicate, '__name__', 'condition')} not true after "
            f"{timeout}s; last value: {value!r}"
        )
    assert value is not None
    return value


def start_or_skip(box: Box) -> Box:
    """`box` booted, or the test skipped on a host that cannot boot one (no root, no systemd)."""
    import pytest  # only a test asks to be skipped; bench/ boots boxes without pytest

    try:
        box.start()
    except BoxUnavailable as why:
        pytest.skip(f"no systemd box on this host: {why}")
    return box


def unit_file_text(text: str) -> str:
    """Unit text as written in a test (indented triple-quoted string) -> file contents."""
    return textwrap.dedent(text).lstrip("\n")


def _cgroup2_parent() -> Path:
    """The host's cgroup2 directory of this process, under which a box gets its own."""
    mount_point = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] == "cgroup2":
            fields = left.split()
            if "ro" in fields[5].split(","):
                raise BoxUnavailable(f"cgroup2 is mounted read-only at {fields[4]}")
            mount_point = Path(fields[4])
            break
    if mount_point is None:
        raise BoxUnavailable("no cgroup2 file system is mounted (needed for the box's cgroup)")
    own = next(
        (line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
         if line.startswith("0::")),
        "/",
    )  # fmt: skip
    parent = mount_point / own.lstrip("/")
    if not os.access(parent, os.W_OK):
        raise BoxUnavailable(f"cannot create a cgroup under {parent}")
    return parent


def remove_cgroup(cgroup: Path, timeout: float = 10.0) -> None:
    """Remove a cgroup directory and its children, deepest first; absent is fine."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            for directory, _, _ in os.walk(cgroup, topdown=False):
                os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError:
            # EBUSY: the killed processes are not all reaped yet.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _check_host() -> None:
    if os.geteuid() != 0:
        raise BoxUnavailable("booting systemd in namespaces needs root")
    for tool in ("unshare", "nsenter", "setpriv", "mount", "ip"):
        if shutil.which(tool) is None:
            raise BoxUnavailable(f"{tool} is not installed")
    for binary in (SYSTEMD, JOURNALD):
        if not os.access(binary, os.X_OK):
            raise BoxUnavailable(f"{binary} is missing (systemd not installed)")


def _under(path: Path, directory: str) -> bool:
    return path == Path(directory) or Path(directory) in path.parents


class Box:
    """One systemd booted as PID 1 of private namespaces; see the module docstring."""

    def __init__(
        self,
        workdir: Path,
        *,
        keep: Sequence[Path] = (),
        devices: Sequence[Path] = (),
        python: Path | None = None,
        boot_timeout: float = 30.0,
    ) -> None:
        """`workdir`: the box's own directory (unit files, console log), created if needed.

        `keep`: more host directories the box must see even though they lie under a
        masked directory (the work directory, the repository and the interpreter's
        prefixes are always kept). `devices`: host device nodes to bind into the box's
        private /dev (e.g. /dev/nvidia0). `python`: the interpreter for http_get and for
        tests' units; default: the one running the tests (the project venv).
        """
        self.workdir = workdir.resolve()
        self.name = f"kimi-box-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.unit_dir = self.workdir / "units"
        self.python = python or Path(sys.executable)
        self.devices = tuple(devices)
        self.boot_timeout = boot_timeout
        self.boot_seconds: float | None = None
        self._keep = (self.workdir, REPO_ROOT, Path(sys.prefix), Path(sys.base_prefix), *keep)
        self._console = self.workdir / "console"
        self._launcher_log = self.workdir / "launcher.log"
        self._launcher: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._pidfd: int | None = None
        self.cgroup: Path | None = None
        self._sentinel: Path | None = None
        self._before: HostSnapshot | None = None
        self._after: HostSnapshot | None = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> Box:
        """Boot and wait until systemd reports the boot finished (`running`)."""
        _check_host()
        cgroup_parent = _cgroup2_parent()
        self._write_units()
        # An old file in /tmp: exactly what systemd-tmpfiles would delete at boot.
        self._sentinel = Path("/tmp") / f"{self.name}.sentinel"
        self._sentinel.write_text("a booting box must leave this file alone\n")
        old = time.time() - 30 * 86400
        os.utime(self._sentinel, (old, old))
        self._before = HostSnapshot.take()
        started = time.monotonic()
        self.cgroup = cgroup_parent / self.name
        self.cgroup.mkdir()
        try:
            self._launch()
            self._wait_booted()
        except BaseException:
            self.stop()
            raise
        self.boot_seconds = time.monotonic() - started
        return self

    def stop(self) -> None:
        """SIGKILL the box's PID 1 (by pidfd, never by name): everything inside dies.

        Then remove the box's cgroup subtree and record the host's /tmp and /dev.
        Safe to call more than once and after a failed start.
        """
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            os.close(self._pidfd)
            self._pidfd = None
        if self._launcher is not None:
            if self._pid is None and self._launcher.poll() is None:
                # Killed before its child was found: unshare's --kill-child takes it along.
                self._launcher.kill()
            self._launcher.wait(timeout=30)
            self._launcher = None
        self._pid = None
        if self.cgroup is not None:
            remove_cgroup(self.cgroup)
        if self._before is not None and self._after is None:
            self._after = HostSnapshot.take()
        if self._sentinel is not None and self._sentinel.exists():
            self._sentinel.unlink()

    def __enter__(self) -> Box:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        """The host PID of the box's PID 1 (systemd)."""
        if self._pid is None:
            raise BoxError(f"box {self.name} is not running")
        return self._pid

    @property
    def alive(self) -> bool:
        return self._pid is not None and Path(f"/proc/{self._pid}").exists()

    def host_changes(self) -> list[str]:
        """After stop(): what changed in the host's /tmp and /dev while the box ran."""
        if self._before is None or self._after is None:
            raise BoxError("host_changes() needs a box that was started and stopped")
        changes = self._after.changes_since(self._before)
        if self._sentinel is not None and self._sentinel.name not in self._after.tmp:
            changes.insert(0, f"{self._sentinel} (an old file, as tmpfiles ages them) vanished")
        return changes

    # -- units -------------------------------------------------------------------------

    def install_unit(self, name: str, text: str, *, reload: bool = True) -> Path:
        """Write a unit file into the box's unit directory (dedented); daemon-reload."""
        path = self.unit_dir / name
        path.write_text(unit_file_text(text))
        if reload:
            self.daemon_reload()
        return path

    def install_dropin(self, unit: str, name: str, text: str, *, reload: bool = True) -> Path:
        """Write `<unit>.d/<name>` (".conf" appended if missing); daemon-reload."""
        dropin_dir = self.unit_dir / f"{unit}.d"
        dropin_dir.mkdir(exist_ok=True)
        path = dropin_dir / (name if name.endswith(".conf") else f"{name}.conf")
        path.write_text(unit_file_text(text))
        if reload:
            self.daemon_reload()
        return path

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload", check=True)

    # -- commands inside ---------------------------------------------------------------

    def run(
        self,
        *cmd: str | os.PathLike[str],
        timeout: float = 30.0,
        check: bool = False,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command in all of the box's namespaces (nsenter -t PID -a); text output.

        The environment is a clean one (PATH with the venv's bin first) plus `env`.
        """
        environment = {
            "PATH": f"{self.python.parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:"
            "/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "HOME": "/root",
            "TERM": "dumb",
            "SYSTEMD_PAGER": "",
            "SYSTEMD_COLORS": "0",
            **(env or {}),
        }
        argv = ["nsenter", "-t", str(self.pid), "-a", "--", *(os.fspath(word) for word in cmd)]
        return subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            env=environment,
        )

    def systemctl(
        self, *args: str, timeout: float = 30.0, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """`systemctl ARGS` against the box's systemd."""
        return self.run(
            "systemctl", "--no-pager", "--no-ask-password", *args, timeout=timeout, check=check
        )

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        """`systemctl show -p ...` as a dict (all properties when none are named).

        A property listed more than once (DeviceAllow=, ...) maps to its values joined
        by newlines.
        """
        args = [f"--property={p}" for p in properties]
        done = self.systemctl("show", *args, unit, check=True)
        shown: dict[str, str] = {}
        for line in done.stdout.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                shown[key] = f"{shown[key]}\n{value}" if key in shown else value
        return shown

    def unit_pids(self, unit: str) -> list[int]:
        """PIDs (box numbering) in the unit's cgroup; [] once the cgroup is gone."""
        control_group = self.show(unit, "ControlGroup")["ControlGroup"]
        if not control_group:
            return []
        done = self.run("cat", f"/sys/fs/cgroup{control_group}/cgroup.procs")
        return [int(pid) for pid in done.stdout.split()] if done.returncode == 0 else []

    def journal(self, unit: str, *, output: str = "cat", extra: Iterable[str] = ()) -> str:
        """`journalctl -u UNIT` text: the unit's output and systemd's lines about it."""
        return self.run(
            "journalctl", "--no-pager", "--quiet", "-o", output, "-u", unit, *extra, check=True
        ).stdout

    def http_get(self, url: str, *, timeout: float = 5.0) -> HttpResult:
        """GET `url` from inside the box (its loopback), with the box's python."""
        done = self.run(self.python, "-c", _HTTP_GET, url, str(timeout), timeout=timeout + 10)
        if done.returncode != 0:
            return HttpResult(None, "", f"client failed: {done.stderr.strip()}")
        result = json.loads(done.stdout)
        return HttpResult(result.get("status"), result.get("body", ""), result.get("error"))

    def wait_for(
        self,
        predicate: Callable[[], T | None],
        timeout: float = 10.0,
        interval: float = 0.05,
        what: str = "",
    ) -> T:
        """wait_for(), failing at once with the console log if the box itself died."""

        def checked() -> T | None:
            if not self.alive:
                raise BoxError(f"box {self.name} died\n{self._logs()}")
            return predicate()

        return wait_for(checked, timeout, interval, what or getattr(predicate, "__name__", ""))

    def console(self) -> str:
        """What systemd wrote to the box's /dev/console (a file in the work directory)."""
        return self._console.read_text(errors="replace") if self._console.exists() else ""

    # -- internals -----------------------------------------------------------------

    def _write_units(self) -> None:
        self.unit_dir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "empty").mkdir(exist_ok=True)
        self._console.touch()
        (self.workdir / "journald.conf").write_text(JOURNALD_CONF)
        (self.workdir / "system.conf").write_text(SYSTEM_CONF)
        (self.workdir / "init.sh").write_text(_INIT_SCRIPT)
        for target in STUB_TARGETS:
            (self.unit_dir / f"{target}.target").write_text(
                f"[Unit]\nDescription=kimi-box stub for {target}.target\nDefaultDependencies=no\n"
            )
        (self.unit_dir / BOOT_TARGET).write_text(BOOT_TARGET_TEXT)
        (self.unit_dir / "systemd-journald.socket").write_text(JOURNALD_SOCKET)
        (self.unit_dir / "systemd-journald.service").write_text(JOURNALD_SERVICE)

    def _keep_paths(self) -> list[Path]:
        """Kept paths that a masked directory would hide, outermost only."""
        hidden = sorted(
            {p.resolve() for p in self._keep if any(_under(p.resolve(), m) for m in MASKED_DIRS)}
        )
        for path in hidden:
            if any(str(path) == m for m in MASKED_DIRS):
                raise BoxError(f"cannot keep {path}: it is masked as a whole")
        return [p for p in hidden if not any(q in p.parents for q in hidden)]

    def _init_argv(self) -> list[str]:
        for path in (*self._keep_paths(), *self.devices):
            if any(c.isspace() for c in str(path)):
                raise BoxError(f"path with whitespace cannot be passed to the box: {path}")
        unit_path = f"{self.unit_dir}:/run/systemd/system:/run/systemd/transient"
        empty = self.workdir / "empty"
        return [
            str(self.workdir),
            " ".join(map(str, self._keep_paths())),
            " ".join(map(str, self.devices)),
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG=C.UTF-8",
            f"container={self.name}",
            f"SYSTEMD_UNIT_PATH={unit_path}",
            f"SYSTEMD_GENERATOR_PATH={empty}",
            f"SYSTEMD_ENVIRONMENT_GENERATOR_PATH={empty}",
            str(SYSTEMD),
            f"--unit={BOOT_TARGET}",
            "--log-target=journal-or-kmsg",
            "--log-level=info",
            "--log-color=no",
            "--show-status=no",
        ]

    def _launch(self) -> None:
        assert self.cgroup is not None
        argv = [
            "/bin/sh", "-c", 'echo 0 > "$1/cgroup.procs" && shift && exec "$@"', "sh",
            str(self.cgroup),
            # If the test process dies without stop(), unshare gets SIGKILL and takes
            # the box's PID 1 with it (--kill-child).
            "setpriv", "--pdeathsig", "KILL", "--",
            "unshare", "--cgroup", "--pid", "--fork", "--mount", "--net", "--uts", "--ipc",
            "--mount-proc", "--kill-child=SIGKILL", "--",
            "/bin/sh", str(self.workdir / "init.sh"), *self._init_argv(),
        ]  # fmt: skip
        with self._launcher_log.open("wb") as log:
            self._launcher = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self._pid = self._find_init(self._launcher)
        self._pidfd = os.pidfd_open(self._pid)

    def _find_init(self, launcher: subprocess.Popen[bytes]) -> int:
        """The host PID of unshare's child, checked to be PID 1 of its namespace."""
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if launcher.poll() is not None:
                log = self._launcher_log.read_text(errors="replace")
                if "unshare failed" in log or "Operation not permitted" in log:
                    raise BoxUnavailable(f"cannot create namespaces here: {log.strip()}")
                raise BoxError(f"box init exited with {launcher.returncode}\n{self._logs()}")
            with contextlib.suppress(FileNotFoundError):
                pids = children.read_text().split()
                if pids:
                    pid = int(pids[0])
                    status = Path(f"/proc/{pid}/status").read_text()
                    nspid = next(line for line in status.splitlines() if line.startswith("NSpid:"))
                    if nspid.split()[-1] != "1":
                        raise BoxError(f"unshare's child {pid} is not PID 1 of a namespace")
                    return pid
            time.sleep(0.01)
        raise BoxError(f"unshare started no child within 10s\n{self._logs()}")

    def _wait_booted(self) -> None:
        private = Path(f"/proc/{self.pid}/root/run/systemd/private")
        self.wait_for(private.exists, self.boot_timeout, 0.01, "systemd's private socket")
        done = self.systemctl("is-system-running", "--wait", timeout=self.boot_timeout)
        state = done.stdout.strip()
        if state != "running":
            failed = self.systemctl("--failed").stdout
            raise BoxError(f"box boot ended in state {state!r}\n{failed}\n{self._logs()}")

    def _logs(self) -> str:
        launcher = (
            self._launcher_log.read_text(errors="replace") if self._launcher_log.exists() else ""
        )
        return f"--- launcher log ---\n{launcher}\n--- console ---\n{self.console()}"


_HTTP_GET = """
import json, sys, urllib.error, urllib.request
url, timeout = sys.argv[1], float(sys.argv[2])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    with opener.open(url, timeout=timeout) as response:
        result = {"status": response.status, "body": response.read().decode("utf-8", "replace")}
except urllib.error.HTTPError as error:
    result = {"status": error.code, "body": error.read().decode("utf-8", "replace")}
except Exception as error:
    result = {"status": None, "error": f"{type(error).__name__}: {error}"}
print(json.dumps(result))
"""


def exec_line(*words: str | os.PathLike[str]) -> str:
    """Quote words for an ExecStart= line.

    systemd unquotes like the shell for the quotes shlex uses, but expands `$` and `%`
    itself, so words holding those are refused rather than mangled.
    """
    texts = [os.fspath(w) for w in words]
    for text in texts:
        if "$" in text or "%" in text:
            raise ValueError(f"{text!r}: $ and % have meanings of their own in unit files")
    return " ".join(shlex.quote(text) for text in texts)
