"""The daemon under an interpreter of this virtual environment placed elsewhere, so that what
it finds "next to its interpreter" (py-spy) is what a test puts there: a py-spy that hangs, or
none at all. Everything else (site-packages, the editable install) is this environment's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from testkit.daemon import DaemonProcess, reaped

MAIN = "import sys; from supervisor.cli import main; sys.exit(main())"


def shadow_python(tmp: Path, py_spy: str | None) -> Path:
    """An interpreter of this virtual environment under another directory, so the daemon's
    "py-spy next to my interpreter" is `py_spy` (a script body), or absent (None)."""
    venv = Path(sys.prefix)
    root = tmp / "venv"
    (root / "bin").mkdir(parents=True)
    shutil.copy(venv / "pyvenv.cfg", root / "pyvenv.cfg")
    (root / "lib").symlink_to(venv / "lib")
    (root / "bin" / "python").symlink_to(venv / "bin" / "python")
    if py_spy is not None:
        spy = root / "bin" / "py-spy"
        spy.write_text("#!/bin/sh\n" + py_spy)
        spy.chmod(0o755)
    return root / "bin" / "python"


@contextlib.contextmanager
def start_with(tmp: Path, cfg: dict[str, Any], python: Path) -> Iterator[DaemonProcess]:
    path = tmp / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    env["PATH"] = "/usr/bin:/bin"  # no other py-spy on the way
    with reaped(DaemonProcess.start(path, cfg, env, command=[str(python), "-c", MAIN])) as d:
        yield d
