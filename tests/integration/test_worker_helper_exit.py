"""A short-lived helper process that one of SGLang's workers forks is not SGLang exiting.

Real SGLang 0.5.23's scheduler and detokenizer fork short-lived children while loading; until
they exec (or for good, with a fork-context helper) their command line is the worker's own
(`sglang::scheduler`, or `... multiprocessing.spawn import spawn_main ...` before setproctitle
ran). Such a helper finishing with status 0 while the main process keeps serving must not end
the launch as `exited`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from testkit import base_config, running

pytestmark = pytest.mark.timeout(90)

# `sglang.module` for the daemon: a worker spawned the way SGLang spawns its workers
# (multiprocessing "spawn"), which forks a helper that works for a moment and exits 0; then the
# stand-in runs as SGLang's main process, unchanged.
FAKE = """
import multiprocessing as mp
import os
import runpy
import sys
import time


def worker(marker):
    pid = os.fork()
    if pid == 0:  # the helper: the worker's command line, a moment of work, status 0
        time.sleep(3.0)
        open(marker, "w").close()
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(3600)


if __name__ == "__main__":
    mp.get_context("spawn").Process(target=worker, args=(os.environ["HELPER_MARKER"],)).start()
    sys.argv[0] = "supervisor.standin"
    runpy.run_module("supervisor.standin", run_name="__main__", alter_sys=True)
"""


def test_a_workers_helper_exiting_is_not_a_restart(tmp_path: Path) -> None:
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "helperfork_sglang.py").write_text(FAKE)
    marker = tmp_path / "helper-done"
    cfg = base_config(
        tmp_path,
        sglang={
            "module": "helperfork_sglang",
            "env": {
                "PYTHONPATH": os.pathsep.join([str(mod), *sys.path[1:]]),
                "HELPER_MARKER": str(marker),
                # Loading outlasts the helper's start, so the daemon's tree scans see it.
                "STANDIN_LOAD_SECONDS": "2",
            },
        },
    )
    with running(tmp_path, cfg) as d:
        d.wait_state("ready", timeout=30)
        deadline = time.monotonic() + 20
        while not marker.exists():
            assert time.monotonic() < deadline, "the helper never finished"
            time.sleep(0.05)
        # A liveness probe that started after the helper's exit has been answered.
        done_at = marker.stat().st_mtime
        while True:
            st = d.status()
            probe = st.get("last_probe") or {}
            if probe.get("at", 0) > done_at + 0.5 or st["restarts"]:
                break
            assert time.monotonic() < deadline, f"no probe after the helper's exit: {st}"
            time.sleep(0.05)
        assert st["restarts"] == {}, (st["last_restart"] or {}).get("detail")
        assert st["state"] == "ready"
        assert st["child"]["launch"] == 1
        assert d.stop() == 0
