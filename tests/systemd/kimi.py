"""The production unit, units/kimi-serve.service, installed into a test box.

The unit runs as it ships, every sandboxing setting included, with one test drop-in
on top that changes only what a box cannot provide:

- User=root: the box has no `kimi` user, and the test tree is root's.
- PrivateTmp=no and ReadWritePaths=: test files live in pytest's tmp_path under
  /tmp; a private /tmp would hide them and ProtectSystem=strict would make them
  read-only. (The box's /tmp is itself a tmpfs: nothing reaches the host's.)
- ExecStart=: the command under test, e.g. the venv's `kimi-serve run --config FILE`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .box import REPO_ROOT, Box, exec_line

UNIT_NAME = "kimi-serve.service"
UNIT_FILE = REPO_ROOT / "units" / UNIT_NAME


def dropin_text(
    box: Box,
    exec_start: Sequence[str | os.PathLike[str]],
    *,
    environment: Mapping[str, str] | None = None,
    read_write_paths: Sequence[Path] = (),
    extra: str = "",
) -> str:
    """The drop-in text described in the module docstring."""
    writable = " ".join(str(p) for p in (box.workdir, *read_write_paths))
    lines = [
        "[Service]",
        "User=root",
        "Group=root",
        "SupplementaryGroups=",
        "PrivateTmp=no",
        f"ReadWritePaths={writable}",
        *(f'Environment="{key}={value}"' for key, value in (environment or {}).items()),
        "ExecStart=",
        f"ExecStart={exec_line(*exec_start)}",
        extra,
    ]
    return "\n".join(lines) + "\n"


def install_kimi_serve(
    box: Box,
    exec_start: Sequence[str | os.PathLike[str]],
    *,
    environment: Mapping[str, str] | None = None,
    read_write_paths: Sequence[Path] = (),
    extra: str = "",
) -> None:
    """Install the shipped unit plus the test drop-in (50-test.conf); daemon-reload.

    `extra`: more drop-in lines for the [Service] section (e.g. "WatchdogSec=2s").
    """
    box.install_unit(UNIT_NAME, UNIT_FILE.read_text(), reload=False)
    dropin = dropin_text(
        box,
        exec_start,
        environment=environment,
        read_write_paths=read_write_paths,
        extra=extra,
    )
    box.install_dropin(UNIT_NAME, "50-test.conf", dropin)
