"""The Debian package: what it contains, and what installing it does under a real systemd.

`test_install_start_upgrade_stop_remove_purge` installs the .deb with `dpkg -i` inside the
systemd box, as on a server: the unit file, user and config the package installs are
used as installed, with no test drop-in. The box's /usr, /etc, /opt and dpkg database
are overlays (testkit/debbox.py), so the host is untouched; the test checks that on the host
before and after. The daemon runs the SGLang stand-in from the package's own
environment (`sglang.python: /opt/kimi-serve/bin/python`, `module: supervisor.standin`).

The .deb is built once per session by packaging/build (about 40 s), or taken from
$KIMI_SERVE_DEB. See packaging/README.md.
"""

from __future__ import annotations

import gzip
import io
import re
import subprocess
import tarfile
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from testkit import base_config
from testkit.box import REPO_ROOT, Box, start_or_skip
from testkit.debbox import DPKG_DB, HostState, NotContained, check_contained, host_state, in_box, ok
from testkit.observability import (
    RUNBOOK_DEFAULT_URL,
    RUNBOOK_INSTALLED,
    unknown_runbook_anchors,
)

UNIT = "kimi-serve.service"
CONFIG = "/etc/kimi-serve/kimi-serve.yaml"
VENV = "/opt/kimi-serve"
LOCK = REPO_ROOT / "packaging" / "requirements.lock"
ADMIN = "127.0.0.1:29400"
MODEL_DIR = "/var/lib/kimi-test/model"  # in the box's own tmpfs, readable by kimi

# -- the lock (no build needed) -----------------------------------------------------------------


def _locked() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[_canonical(name)] = version
    return pins


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_lock_pins_every_dependency_within_pyproject_ranges() -> None:
    """The lock satisfies pyproject.toml (if not: `packaging/build --update-lock`)."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    pins = _locked()
    for spec in project["dependencies"]:
        requirement = Requirement(spec)
        name = _canonical(requirement.name)
        assert name in pins, f"{name} is not in {LOCK.name}: run packaging/build --update-lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{LOCK.name} pins {name}=={pins[name]}, outside pyproject.toml's {spec!r}: "
            "run packaging/build --update-lock"
        )


# -- the package's contents -------------------------------------------------------------------


def _unpack(deb: Path, part: str) -> tuple[dict[str, tarfile.TarInfo], dict[str, bytes]]:
    """One of the .deb's archives (--fsys-tarfile, --ctrl-tarfile): members and file bytes."""
    data = subprocess.run(["dpkg-deb", part, str(deb)], capture_output=True, check=True).stdout
    members: dict[str, tarfile.TarInfo] = {}
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            path = "/" + member.name.removeprefix("./")
            members[path] = member
            handle = tar.extractfile(member) if member.isfile() else None
            if handle is not None:
                files[path] = handle.read()
    return members, files


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_package_contents(deb: Path) -> None:
    members, files = _unpack(deb, "--fsys-tarfile")
    _, control = _unpack(deb, "--ctrl-tarfile")
    scripts = {path.lstrip("/"): data.decode() for path, data in control.items()}
    fields = dict(line.split(": ", 1) for line in scripts["control"].splitlines() if ": " in line)
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert fields["Package"] == "kimi-serve"
    assert fields["Version"].startswith(f"{version}-")
    depends = [d.strip() for d in fields["Depends"].split(",")]
    # The environment links to /usr/bin/python3.11 and its extension modules are cpython-311.
    assert "python3.11" in depends
    assert any(d.startswith("systemd") for d in depends)  # systemd-sysusers in the postinst

    # The shipped files are the repository's, byte for byte.
    share = "/usr/share/kimi-serve"
    for installed, source in [
        ("/lib/systemd/system/kimi-serve.service", "units/kimi-serve.service"),
        (CONFIG, "etc/kimi-serve.yaml"),
        (f"{share}/prometheus/kimi-serve-rules.yml", "etc/prometheus/kimi-serve-rules.yml"),
        (f"{share}/grafana/kimi-serve.json", "etc/grafana/kimi-serve.json"),
        ("/usr/share/bash-completion/completions/kimi-serve", "packaging/completion/kimi-serve"),
        ("/usr/share/zsh/vendor-completions/_kimi-serve", "packaging/completion/_kimi-serve"),
    ]:
        assert files[installed] == (REPO_ROOT / source).read_bytes(), installed
    man = gzip.decompress(files["/usr/share/man/man1/kimi-serve.1.gz"])
    assert man == (REPO_ROOT / "packaging" / "kimi-serve.1").read_bytes()

    # The runbook, uncompressed where every alert links to it by default, and every alert of
    # the shipped rules landing on a heading of the shipped runbook.
    runbook = files[RUNBOOK_INSTALLED]
    assert runbook == (REPO_ROOT / "docs" / "runbook.md").read_bytes()
    assert f"{RUNBOOK_INSTALLED}.gz" not in members
    shipped_rules = yaml.safe_load(files[f"{share}/prometheus/kimi-serve-rules.yml"])
    alerts = [r for g in shipped_rules["groups"] for r in g["rules"] if "alert" in r]
    assert alerts
    assert all(RUNBOOK_DEFAULT_URL in r["annotations"]["runbook_url"] for r in alerts)
    assert unknown_runbook_anchors(alerts, runbook.decode()) == []

    # Only the config is a conffile.
    assert scripts["conffiles"].split() == [CONFIG]
    # Neither enabled nor started on install; on upgrade a running daemon hands over
    # (`kimi-serve reexec`), try-restarted (only if running) where it cannot, before
    # debhelper's own snippet, which neither restarts nor stops it.
    postinst = scripts["postinst"]
    assert "was-enabled" in postinst  # `deb-systemd-helper enable` only if it was enabled
    assert re.search(r"deb-systemd-invoke (start|restart) ", postinst) is None
    ours, _, debhelper = postinst.partition("# Automatically added by dh_installsystemd")
    assert "/usr/bin/kimi-serve reexec" in ours
    assert 'deb-systemd-invoke try-restart "$unit"' in ours
    assert "try-restart" not in debhelper
    assert "systemd-sysusers" in postinst and "kimi-serve.conf" in postinst
    assert "deb-systemd-invoke stop kimi-serve.service" in scripts["prerm"]
    assert "preinst" not in scripts  # no stop before an upgrade: try-restart after it

    assert files["/usr/lib/sysusers.d/kimi-serve.conf"].decode().count("\nu kimi ") == 1
    link = members["/usr/bin/kimi-serve"]
    assert link.issym() and link.linkname == f"{VENV}/bin/kimi-serve"
    assert members[f"{VENV}/bin/python3.11"].linkname == "/usr/bin/python3.11"
    assert files[f"{VENV}/bin/kimi-serve"].decode().startswith(f"#!{VENV}/bin/python\n")

    site = f"{VENV}/lib/python3.11/site-packages"
    # The stand-in is in the environment (kimi-serve demo, and the test below, use it).
    assert f"{site}/supervisor/standin/__main__.py" in members
    # dpkg owns the environment: no installer in it.
    assert not [n for n in members if n.startswith((f"{site}/pip/", f"{site}/setuptools/"))]
    # Every module has its bytecode (the service cannot write any: /opt is read-only to it).
    modules = [n for n in members if n.startswith(f"{site}/supervisor/") and n.endswith(".py")]
    assert modules
    for module in modules:
        parent, name = module.rsplit("/", 1)
        pyc = files[f"{parent}/__pycache__/{name[:-3]}.cpython-311.pyc"]
        # PEP 552 flags 0b11: validated by the source's hash, not its mtime, which dpkg-deb
        # clamps to the changelog's date.
        assert int.from_bytes(pyc[4:8], "little") == 0b11, module
    # The versions are the lock's.
    shipped = files["/usr/share/doc/kimi-serve/requirements.lock"].decode()
    pins = {_canonical(n): v for n, _, v in (x.partition("==") for x in shipped.split())}
    assert pins == _locked()


# -- installed under a real systemd -----------------------------------------------------------


def _stand_in_config(tmp_path: Path, marker: str) -> str:
    """The shipped layout, pointed at the stand-in in the package's own environment."""
    cfg: dict[str, Any] = base_config(tmp_path)
    cfg["sglang"].update(
        python=f"{VENV}/bin/python",
        module="supervisor.standin",
        model_path=MODEL_DIR,
        port=30000,
    )
    # Counter files belong to the host-side harness; the unit's /tmp is private anyway.
    cfg["sglang"]["env"].pop("STANDIN_LAUNCH_COUNTER", None)
    cfg["admin"]["listen"] = ADMIN
    cfg["state_dir"] = None  # $STATE_DIRECTORY: /var/lib/kimi-serve, from the unit
    return f"# {marker}\n" + yaml.safe_dump(cfg, sort_keys=False)


def _show(box: Box, *names: str) -> dict[str, str]:
    return box.show(UNIT, *names)


def _start(box: Box) -> dict[str, str]:
    """`systemctl start` (returns at READY=1), then the unit's state; fails with its journal."""
    done = box.systemctl("start", UNIT, timeout=120)
    assert done.returncode == 0, f"start failed: {done.stderr}\n{box.journal(UNIT)[-4000:]}"
    return _show(box, "ActiveState", "SubState", "MainPID", "StatusText")


def _ready(box: Box) -> None:
    got = box.http_get(f"http://{ADMIN}/readyz")
    assert got.status == 200, f"/readyz: {got}\n{box.journal(UNIT)[-3000:]}"


def _kimi_processes(box: Box) -> list[str]:
    done = in_box(box, "pgrep", "-a", "-u", "kimi")
    return done.stdout.splitlines()


def _owner(box: Box, pid: str) -> str:
    return ok(box, "ps", "-o", "user=", "-p", pid).strip()


def _exists(box: Box, path: str) -> bool:
    """A path (or a dangling link) exists inside the box."""
    return in_box(box, "sh", "-c", 'test -e "$1" || test -L "$1"', "-", path).returncode == 0


@pytest.mark.systemd
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_install_start_upgrade_stop_remove_purge(deb: Path, deb_box: Box, tmp_path: Path) -> None:
    box = deb_box
    before = host_state()
    problems = before.problems()
    if problems:
        pytest.skip(f"kimi-serve is (partly) installed on this host: {problems}")

    # A container's policy-rc.d (exit 101) forbids maintainer scripts to touch services;
    # a GPU host has none. Removed in the box's overlay only.
    ok(box, "rm", "-f", "/usr/sbin/policy-rc.d")
    # The box's systemd sees units only in its own directories (box.py), not in
    # /lib/systemd/system: a runtime link there makes the installed file visible, as is.
    ok(box, "ln", "-s", "/lib/systemd/system/kimi-serve.service", f"/run/systemd/system/{UNIT}")
    package = box.workdir / deb.name  # the box sees its work directory, not the session's tmp
    package.write_bytes(deb.read_bytes())

    # -- install ------------------------------------------------------------------------------
    ok(box, "dpkg", "-i", str(package))
    assert "install ok installed" in ok(box, "dpkg-query", "-W", "-f", "${Status}", "kimi-serve")
    assert ok(box, "readlink", "/usr/bin/kimi-serve").strip() == f"{VENV}/bin/kimi-serve"
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert ok(box, "kimi-serve", "--version").split() == ["kimi-serve", project["version"]]
    shipped_unit = (REPO_ROOT / "units" / UNIT).read_text()
    assert ok(box, "cat", "/lib/systemd/system/kimi-serve.service") == shipped_unit
    # The system user, from sysusers.d: no login, home = the unit's state directory.
    user = ok(box, "getent", "passwd", "kimi").strip().split(":")
    assert user[5:] == ["/var/lib/kimi-serve", "/usr/sbin/nologin"], user
    assert 0 < int(user[2]) < 1000, user
    # Installed, not enabled, not started.
    assert in_box(box, "systemctl", "is-active", UNIT).stdout.strip() == "inactive"
    assert not _exists(box, f"/etc/systemd/system/multi-user.target.wants/{UNIT}")
    assert _show(box, "LoadState", "UnitFileState") == {
        "LoadState": "loaded",
        "UnitFileState": "linked-runtime",  # the test's link, not an enablement
    }

    # -- configure and start, as the README says ----------------------------------------------
    ok(box, "mkdir", "-p", MODEL_DIR)
    model_config = '{"architectures": ["DeepseekV3ForCausalLM"]}\n'
    done = box.run("tee", f"{MODEL_DIR}/config.json", input=model_config)
    assert done.returncode == 0, done.stderr
    marker = f"site edit {uuid.uuid4().hex}"
    site_config = _stand_in_config(tmp_path, marker)
    done = box.run("tee", CONFIG, input=site_config)
    assert done.returncode == 0, done.stderr
    assert ok(box, "runuser", "-u", "kimi", "--", "kimi-serve", "check").strip() == "ok"

    started = _start(box)
    assert started["ActiveState"] == "active" and started["SubState"] == "running", started
    _ready(box)
    main = started["MainPID"]
    assert _owner(box, main) == "kimi"
    assert in_box(box, "kimi-serve", "status").returncode == 0  # 0 = ready
    # The stand-in (SGLang) runs from the package's environment, as kimi, in the unit.
    sglang = [p for p in _kimi_processes(box) if "-m supervisor.standin " in p]
    assert sglang and sglang[0].split()[1] == f"{VENV}/bin/python", _kimi_processes(box)
    assert ok(box, "stat", "-c", "%U %a", "/var/lib/kimi-serve").split() == ["kimi", "750"]

    # -- upgrade in place: the edited conffile stays, the running daemon hands over ------------
    upgraded = ok(box, "dpkg", "-i", "--force-confold", str(package))
    assert "handed over to the new version" in upgraded, upgraded
    assert ok(box, "cat", CONFIG) == site_config
    leftovers = in_box(box, "sh", "-c", "ls /etc/kimi-serve/*.dpkg-* 2>/dev/null").stdout
    assert leftovers == "", leftovers
    after_upgrade = _show(box, "ActiveState", "MainPID")
    assert after_upgrade["ActiveState"] == "active"
    assert after_upgrade["MainPID"] == main, "the upgrade restarted the daemon"
    # SGLang was adopted by the new code, not relaunched.
    assert next(p for p in _kimi_processes(box) if "-m supervisor.standin " in p) == sglang[0]
    _ready(box)
    journal = box.journal(UNIT)
    assert "hand-over complete" in journal, journal[-3000:]

    # -- stop: nothing left ------------------------------------------------------------------
    stop = box.systemctl("stop", UNIT, timeout=120)
    assert stop.returncode == 0, stop.stderr
    stopped = _show(box, "ActiveState", "Result", "ExecMainStatus")
    assert stopped == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}
    assert box.unit_pids(UNIT) == []
    assert _kimi_processes(box) == []

    # -- remove while running: stopped first, the conffile stays ----------------------------
    _start(box)
    _ready(box)
    ok(box, "dpkg", "-r", "kimi-serve")
    assert in_box(box, "systemctl", "is-active", UNIT).stdout.strip() == "inactive"
    assert _kimi_processes(box) == []
    status = ok(box, "dpkg-query", "-W", "-f", "${Status}", "kimi-serve")
    assert status == "deinstall ok config-files", status
    assert ok(box, "cat", CONFIG) == site_config
    for path in (VENV, "/usr/bin/kimi-serve", "/lib/systemd/system/kimi-serve.service"):
        assert not _exists(box, path), f"{path} is still there after dpkg -r"

    # -- purge: every file gone; the user stays (Debian practice) -----------------------------
    ok(box, "dpkg", "--purge", "kimi-serve")
    assert in_box(box, "dpkg-query", "-W", "kimi-serve").returncode != 0
    for path in (
        "/etc/kimi-serve", VENV, "/usr/share/kimi-serve", "/usr/share/doc/kimi-serve",
        "/usr/lib/sysusers.d/kimi-serve.conf", "/var/lib/kimi-serve", "/var/cache/kimi-serve",
    ):  # fmt: skip
        assert not _exists(box, path), f"{path} is still there after dpkg --purge"
    assert in_box(box, "getent", "passwd", "kimi").returncode == 0

    # -- the host: as before (checked again once the box is gone) ---------------------------
    after = host_state()
    assert after == before, f"the host changed: before {before}, after {after}"
    assert after.problems() == []


def test_host_state_sees_an_installed_package() -> None:
    """host_state() would notice the package: its checks are not vacuous."""
    state = HostState(
        present=("/opt/kimi-serve",), dpkg_status="install ok installed 0.1.0-1",
        kimi_user=True, dpkg_db_files=3, mounted=(),
    )  # fmt: skip
    assert len(state.problems()) == 3


@pytest.mark.systemd
def test_a_box_without_the_overlays_is_refused(tmp_path: Path) -> None:
    """check_contained() stops before any write when the overlays are missing."""
    box = Box(tmp_path / "box", keep=[DPKG_DB])
    start_or_skip(box)
    try:
        with pytest.raises(NotContained, match="/var/lib/dpkg is not an overlay"):
            check_contained(box)
    finally:
        box.stop()
    assert box.host_changes() == []
