"""A tiny sd_notify service for the box tests, run as a unit's ExecStart.

It behaves like the kimi-serve daemon towards systemd, in miniature: STATUS= lines,
READY=1 after a delay (optionally pushing the start deadline with
EXTEND_TIMEOUT_USEC=), then WATCHDOG=1 at half of WATCHDOG_USEC until stopped.
Standalone (the project venv's python and sdnotify only): it runs inside the box.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import sdnotify

# A child that ignores SIGTERM, like an SGLang worker that will not die politely.
STUBBORN_CHILD = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "while True: time.sleep(3600)\n"
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--say", help="print this line to stdout at start")
    parser.add_argument("--ready-after", type=float, default=0.0, help="seconds before READY=1")
    parser.add_argument(
        "--extend-usec", type=int, help="while waiting, send EXTEND_TIMEOUT_USEC=this"
    )
    parser.add_argument("--status", default="ready", help="STATUS= sent with READY=1")
    parser.add_argument("--marker", type=Path, help="file written just before READY=1")
    parser.add_argument("--child-pid-file", type=Path, help="start a stubborn child, record it")
    parser.add_argument("--exit", type=int, help="exit with this status instead of READY=1")
    return parser.parse_args(argv)


def wait_until_ready(
    notifier: sdnotify.SystemdNotifier, seconds: float, extend_usec: int | None
) -> None:
    deadline = time.monotonic() + seconds
    # A third of the extension: two pushes may be late before the deadline passes.
    step = extend_usec / 3e6 if extend_usec else seconds
    while (left := deadline - time.monotonic()) > 0:
        if extend_usec:
            notifier.notify(f"EXTEND_TIMEOUT_USEC={extend_usec}")
        time.sleep(min(step, left))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    notifier = sdnotify.SystemdNotifier()
    if args.say:
        print(args.say, flush=True)
    notifier.notify("STATUS=starting")
    if args.exit is not None:
        print(f"exiting with {args.exit}", flush=True)
        return int(args.exit)
    if args.child_pid_file:
        child = subprocess.Popen([sys.executable, "-c", STUBBORN_CHILD])
        args.child_pid_file.write_text(f"{child.pid}\n")
    wait_until_ready(notifier, args.ready_after, args.extend_usec)
    if args.marker:
        args.marker.write_text(f"{time.monotonic()}\n")
    notifier.notify(f"READY=1\nSTATUS={args.status}")
    watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0"))
    interval = watchdog_usec / 2e6 if watchdog_usec else 3600.0
    while True:
        if watchdog_usec:
            notifier.notify("WATCHDOG=1")
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
