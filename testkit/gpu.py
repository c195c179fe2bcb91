"""Real processes for the GPU tests: sleepers whose command lines look like SGLang's (or not).

Every process started through `Procs` is killed (identity-checked) by `cleanup()`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from supervisor.config import GpusConfig
from supervisor.gpu.sim import ENV_TAG
from supervisor.process.identity import ProcessIdentity, identity_of, signal_identity

# Reports its pid once its signal disposition is in place, then waits for signals forever.
HOLDER = """
import os, signal, sys
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.write(1, b"ready %d\\n" % os.getpid())
while True:
    signal.pause()
"""
# Starts its arguments in a new session and exits at once: the holder is orphaned, as an
# SGLang scheduler is when its parent dies before PR_SET_PDEATHSIG (sglang #23627).
# An interpreter outside root's home, which other users can run.
SYSTEM_PYTHON = "/usr/bin/python3"
LAUNCHER = "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True)"


class Procs:
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.env = {**os.environ, ENV_TAG: tag}
        self.popens: list[subprocess.Popen[bytes]] = []
        self.started: list[ProcessIdentity] = []

    def start(
        self,
        *args: str,
        ignore_term: bool = False,
        orphan: bool = False,
        user: int | None = None,
    ) -> ProcessIdentity:
        """A holder with `args` on its command line, as `user` (uid; default: ours)."""
        # Another user cannot run the test's interpreter when it lives under root's home.
        python = sys.executable if user is None else SYSTEM_PYTHON
        argv = [python, "-c", HOLDER, *(["--ignore-term"] if ignore_term else []), *args]
        if orphan:
            argv = [python, "-c", LAUNCHER, *argv]
        as_user = {} if user is None else {"user": user, "group": user, "extra_groups": []}
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, env=self.env, **as_user)  # type: ignore[call-overload]
        self.popens.append(p)
        assert p.stdout is not None
        line = p.stdout.readline().split()
        assert line[:1] == [b"ready"], f"holder did not start: {line!r}"
        pid = int(line[1])
        if orphan:
            assert p.wait(timeout=10) == 0
        ident = identity_of(pid)
        assert ident is not None
        self.started.append(ident)
        return ident

    def child_popen(self, ident: ProcessIdentity) -> subprocess.Popen[bytes]:
        return next(p for p in self.popens if p.pid == ident.pid)

    def cleanup(self) -> None:
        for ident in self.started:
            signal_identity(ident, signal.SIGKILL)
        for p in self.popens:
            with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
                p.wait(timeout=10)
            if p.stdout is not None:
                p.stdout.close()


def gpus_cfg(**over: object) -> GpusConfig:
    base: dict[str, object] = {
        "manage": True,
        "devices": "all",
        "leftover_policy": "kill-matching",
        "match": ("sglang", "launch_server"),
        "memory_free_timeout": 3.0,
        "memory_free_threshold_mib": 1024,
    }
    base.update(over)
    return GpusConfig(**base)  # type: ignore[arg-type]
