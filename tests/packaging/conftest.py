"""Fixtures for the Debian package's tests: the built .deb, and a box to install it in."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.box import REPO_ROOT, Box, start_or_skip
from testkit.debbox import DPKG_DB, contain_dpkg, host_state

BUILD = REPO_ROOT / "packaging" / "build"
BUILD_DEPS = ("dpkg-dev", "debhelper", "dh-virtualenv", "python3.11", "python3.11-venv", "lintian")


def _installed(package: str) -> bool:
    done = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Status}", package], capture_output=True, text=True
    )
    return done.stdout.strip() == "install ok installed"


@pytest.fixture(scope="session")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kimi-serve .deb: $KIMI_SERVE_DEB if set, else built once per session.

    The build is packaging/build itself (lintian included: a lintian error fails it),
    writing into a session directory rather than dist/.
    """
    given = os.environ.get("KIMI_SERVE_DEB")
    if given:
        path = Path(given).resolve()
        assert path.is_file(), f"KIMI_SERVE_DEB={given} is not a file"
        return path
    if shutil.which("dpkg-buildpackage") is None and shutil.which("apt-get") is None:
        pytest.skip("not a Debian system: no dpkg-buildpackage and no apt-get")
    if os.geteuid() != 0 and not all(_installed(p) for p in BUILD_DEPS):
        pytest.skip(f"build dependencies missing and not root to install them: {BUILD_DEPS}")
    out = tmp_path_factory.mktemp("deb")
    done = subprocess.run(
        [str(BUILD), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"packaging/build failed:\n{done.stderr[-6000:]}"
    debs = sorted(out.glob("kimi-serve_*.deb"))
    assert len(debs) == 1, f"expected one .deb in {out}: {debs}"
    return debs[0]


@pytest.fixture
def deb_box(tmp_path: Path) -> Iterator[Box]:
    """A booted box whose /usr, /etc, /opt and dpkg database are overlays (see testkit/debbox.py).

    Killed after the test, which fails if the box changed the host's /tmp or /dev, or
    anything of the host that installing kimi-serve would change (testkit.debbox.HostState).
    """
    before = host_state()
    booted = Box(tmp_path / "box", keep=[DPKG_DB])
    start_or_skip(booted)
    try:
        contain_dpkg(booted)
        yield booted
    finally:
        booted.stop()
    changes = booted.host_changes()
    assert not changes, f"the box changed the host: {changes}"
    after = host_state()
    assert after == before, f"the host changed: before {before}, after {after}"
