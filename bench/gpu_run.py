"""What the GPU crash benches (bench/gpu_fitness.py, bench/gpu_multi.py) share: the scene a
SIGKILLed daemon leaves behind (a work directory, the holder script, a state directory and the
owner marker derived from it), and the way a run ends (a line per check, the exit code)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, NamedTuple

from supervisor.gpu.nvml import NvmlUnavailable
from supervisor.process.identity import owner_marker


class Scene(NamedTuple):
    holder: Path  # the holder script, written out
    state: Path  # the dead daemon's state directory (its launch record goes here)
    marker: str  # the owner marker of a daemon with that state directory


def scene(prefix: str, holder_text: str) -> Scene:
    work = Path(tempfile.mkdtemp(prefix=prefix))
    holder = work / "holder.py"
    holder.write_text(holder_text)
    state = work / "state"
    state.mkdir()
    return Scene(holder, state, owner_marker(str(state)))


def verdict(checks: dict[str, bool]) -> int:
    """Print a line per check; 0 when every check held."""
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


def run(
    main_async: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
    args: argparse.Namespace,
) -> int:
    """The bench's loop; NVML missing is one line and exit 1, never a traceback."""
    try:
        return asyncio.run(main_async(args))
    except NvmlUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
