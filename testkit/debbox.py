"""Installing the .deb for real, inside the systemd box, with the host left untouched.

`dpkg -i` writes /opt, /usr, /etc and the dpkg database, and its maintainer scripts add
a user to /etc/passwd. The box (testkit/box.py) shares the host's file systems:
its own tmpfs covers /tmp, /var/lib, /var/cache, /var/log, /etc/systemd and /run, but
/usr, /etc and /opt are the host's, writable. So before anything is installed,
`contain_dpkg()` mounts, inside the box's private mount namespace, an overlay on each of

    /usr  /etc  /opt  /var/lib/dpkg

with the host's directory as the read-only lower layer and an upper layer on the box's
own /run (a tmpfs that dies with the box). dpkg then sees the host's real database (so
python3.11, systemd and the other dependencies are installed, as on a server) and
everything it writes lands in the upper layers. Mounts the box had made below those
paths (its tmpfs on /etc/systemd) are moved aside and put back on top of the overlay.

/var/lib/dpkg lies under the box's tmpfs on /var/lib, so the box must be booted with
`keep=[Path("/var/lib/dpkg")]`, which binds the host's database back in; the first thing
`contain_dpkg()` does is make that bind read-only, before it is covered.

Nothing is mounted on the host: the mounts belong to the box's mount namespace and go
when its PID 1 is killed. `check_contained()` proves the overlays are in place (a file
written inside is absent outside) before any dpkg command runs.
"""

from __future__ import annotations

import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from testkit.box import Box

OVERLAID = ("/var/lib/dpkg", "/opt", "/usr", "/etc")
DPKG_DB = Path("/var/lib/dpkg")

# Runs as root in all of the box's namespaces. /var/lib/dpkg first: it is the host's
# database, bound in writable by the box, and is made read-only before anything else.
_CONTAIN = r"""
set -euf
mount -o remount,bind,ro /var/lib/dpkg
layers=/run/kimi-deb-layers
for d in {overlaid}; do
    base=$layers/$(printf %s "$d" | tr / _)
    mkdir -p "$base/upper" "$base/work" "$base/aside"
    # Top-level mounts below $d (e.g. the box's tmpfs on /etc/systemd): set aside.
    kept=""
    for m in $(findmnt -rn -o TARGET | awk -v p="$d/" 'index($0, p) == 1' | sort); do
        inner=0
        for k in $kept; do case $m in "$k"/*) inner=1 ;; esac; done
        [ "$inner" = 0 ] || continue
        kept="$kept $m"
    done
    i=0
    for m in $kept; do
        mkdir "$base/aside/$i"; mount --move "$m" "$base/aside/$i"; i=$((i + 1))
    done
    mount -t overlay overlay \
        -o "lowerdir=$d,upperdir=$base/upper,workdir=$base/work" "$d"
    i=0
    for m in $kept; do
        mount --move "$base/aside/$i" "$m"; rmdir "$base/aside/$i"; i=$((i + 1))
    done
done
""".replace("{overlaid}", " ".join(OVERLAID))

# A clean environment for dpkg and its maintainer scripts: no project venv on PATH.
SYSTEM_ENV = {
    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
    "DEBIAN_FRONTEND": "noninteractive",
}


class NotContained(AssertionError):
    """The overlays are not (all) in place: no dpkg command may run."""


def contain_dpkg(box: Box) -> None:
    """Mount the overlays described in the module docstring; check they work."""
    done = box.run("sh", "-c", _CONTAIN, timeout=30)
    if done.returncode != 0:
        raise NotContained(f"could not mount the overlays:\n{done.stdout}\n{done.stderr}")
    check_contained(box)


def check_contained(box: Box) -> None:
    """Each overlaid path is an overlay inside the box, and a write there stays inside."""
    for path in OVERLAID:
        fstype = box.run("findmnt", "-n", "-o", "FSTYPE", "--mountpoint", path).stdout.split()
        if not fstype or fstype[-1] != "overlay":
            raise NotContained(f"{path} is not an overlay inside the box: {fstype}")
        probe = Path(path) / f".kimi-deb-probe-{uuid.uuid4().hex[:8]}"
        box.run("touch", str(probe), check=True)
        try:
            if probe.exists():
                raise NotContained(f"{probe}, written inside the box, appeared on the host")
        finally:
            box.run("rm", "-f", str(probe), check=True)


def in_box(box: Box, *cmd: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """A command in the box with the system's PATH (as a maintainer script sees it)."""
    return box.run(*cmd, env=SYSTEM_ENV, timeout=timeout)


def ok(box: Box, *cmd: str, timeout: float = 120.0) -> str:
    """Run in the box; fail the test with its output unless it exits 0. Returns stdout."""
    done = in_box(box, *cmd, timeout=timeout)
    assert done.returncode == 0, (
        f"{' '.join(cmd)} exited {done.returncode}\n--- stdout\n{done.stdout}"
        f"\n--- stderr\n{done.stderr}"
    )
    return done.stdout


# -- the host's side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HostState:
    """What a kimi-serve install would change on the host, recorded to compare."""

    present: tuple[str, ...]  # package paths that exist on the host
    dpkg_status: str  # `dpkg-query -W kimi-serve` output ("" when unknown to dpkg)
    kimi_user: bool  # a `kimi` line in /etc/passwd
    dpkg_db_files: int  # number of entries in /var/lib/dpkg/info mentioning kimi-serve
    mounted: tuple[str, ...]  # host mount points among the overlaid paths (none leak out)

    def problems(self) -> list[str]:
        """Reasons this host state is not 'kimi-serve absent'."""
        found = [f"{path} exists" for path in self.present]
        if self.dpkg_status:
            found.append(f"dpkg knows kimi-serve: {self.dpkg_status!r}")
        if self.dpkg_db_files:
            found.append("/var/lib/dpkg/info has kimi-serve files")
        return found


# Every path the package installs or its scripts create, as the host would have them.
PACKAGE_PATHS = (
    "/opt/kimi-serve",
    "/usr/bin/kimi-serve",
    "/etc/kimi-serve",
    "/lib/systemd/system/kimi-serve.service",
    "/usr/lib/sysusers.d/kimi-serve.conf",
    "/usr/share/kimi-serve",
    "/usr/share/doc/kimi-serve",
    "/usr/share/man/man1/kimi-serve.1.gz",
    "/var/lib/kimi-serve",
    "/var/cache/kimi-serve",
)


def host_state() -> HostState:
    query = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Status} ${Version}", "kimi-serve"],
        capture_output=True,
        text=True,
        check=False,
    )
    passwd = Path("/etc/passwd").read_text()
    info = DPKG_DB / "info"
    return HostState(
        present=tuple(p for p in PACKAGE_PATHS if Path(p).exists() or Path(p).is_symlink()),
        dpkg_status=query.stdout.strip() if query.returncode == 0 else "",
        kimi_user=any(line.startswith("kimi:") for line in passwd.splitlines()),
        dpkg_db_files=len(list(info.glob("kimi-serve.*"))),
        mounted=tuple(
            point
            for point in (line.split()[4] for line in Path("/proc/self/mountinfo").open())
            if point in OVERLAID
        ),
    )
