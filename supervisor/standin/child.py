"""A scheduler or detokenizer child: `python -m supervisor.standin.child ... --role <title>`.

SGLang's children are real processes named by setproctitle (`sglang::scheduler` with tp 1,
`sglang::scheduler_TP<i>` otherwise, `sglang::detokenizer`; sglang/srt/managers/scheduler.py:6294).
The title arrives as the last argv element (what a child still starting shows) and is then set
as setproctitle sets it (supervisor/standin/proctitle.py): /proc/PID/cmdline becomes the title,
and /proc/PID/environ is wiped unless SPT_NOENV=1.

Like SGLang's `kill_itself_when_parent_died` (PR_SET_PDEATHSIG=SIGKILL) a normal child dies
with the main process. The orphans fault imitates a child that never reached that call
(sglang #23627): it leaves the process group, outlives a SIGKILLed parent and, never having
reached setproctitle either, keeps its start-up command line and environment.

Kept free of heavy imports: tp_size + 1 of these start with every launch.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import time
from collections.abc import Sequence

from supervisor.standin.proctitle import set_title

_PR_SET_PDEATHSIG = 1
_POLL_SECONDS = 0.2


def _prctl(option: int, arg: int | bytes) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the getppid() poll below still ends the child


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supervisor.standin.child")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--orphan", action="store_true")
    p.add_argument("--lifetime", type=float, default=600.0)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--role", required=True)
    args = p.parse_args(argv)

    if args.orphan:
        os.setsid()
    else:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != args.parent_pid:
            return 0  # the parent died before the death signal was armed
    # Ctrl-C in a terminal reaches the whole foreground group; the main process decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not args.orphan:
        # SGLang arms PDEATHSIG first, then sets the title (configure_scheduler_process).
        set_title(args.role)
    # A scheduler reports "ready" to the main process through a pipe once it is set up.
    os.write(args.ready_fd, b"r")
    os.close(args.ready_fd)

    deadline = time.monotonic() + args.lifetime
    while True:
        time.sleep(_POLL_SECONDS)
        if args.orphan:
            if time.monotonic() >= deadline:
                return 0  # never leak forever, even if nobody cleans up
        elif os.getppid() != args.parent_pid:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
