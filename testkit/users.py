"""Real local users for tests where ownership matters: created with useradd when absent.

Tests that need them run as root (they chown, and start processes as these users); without
root they skip, saying why.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess

import pytest


def system_user(name: str) -> pwd.struct_passwd:
    """The user `name`, a system user with no home and no login shell, created if missing."""
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a user and starts processes as it")
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        pytest.skip("needs useradd to create a second user")
    subprocess.run(
        [
            useradd,
            "--system",
            "--user-group",
            "--no-create-home",
            "--shell",
            "/usr/sbin/nologin",
            name,
        ],
        check=True,
        capture_output=True,
    )
    return pwd.getpwnam(name)
