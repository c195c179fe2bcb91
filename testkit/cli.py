"""kimi-serve's commands as processes: `kimi_serve(*args)` runs the installed entry point (no
traceback may reach the operator); `unprivileged=True` drops every capability first."""

from __future__ import annotations

import os
import subprocess

from testkit import BIN

# Root without the capabilities that let it read any file: a stand-in for another local
# user (the interpreter lives under /root here, which no other user may enter).
NO_DAC = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]


def kimi_serve(*args: str, unprivileged: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KIMI_SERVE_CONFIG", "NOTIFY_SOCKET")}
    done = subprocess.run(
        [*(NO_DAC if unprivileged else []), str(BIN), *args],
        capture_output=True,
        stdin=subprocess.DEVNULL,  # never a terminal: a command that asks must not wait
        text=True,
        timeout=30,
        env=env,
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done
