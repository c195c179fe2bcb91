"""Telling systemd the truth, through `sdnotify`. Silent when NOTIFY_SOCKET is unset, so the
daemon behaves the same under Kubernetes or in a terminal."""

from __future__ import annotations

import os
import time

import sdnotify


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._sd = sdnotify.SystemdNotifier() if self.enabled else None

    def _send(self, message: str) -> None:
        if self._sd is not None:
            self._sd.notify(message)

    def ready(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={status}")

    def status(self, text: str) -> None:
        # One line: systemctl status shows only the first.
        self._send("STATUS=" + " ".join(text.split()))

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> None:
        self._send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def stopping(self, status: str) -> None:
        self._send(f"STOPPING=1\nSTATUS={status}")

    def reloading(self) -> None:
        # systemd >= 253 wants MONOTONIC_USEC with RELOADING=1 (Type=notify-reload); older
        # ones ignore it.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}")


def watchdog_interval() -> float | None:
    """Half of WatchdogSec= when systemd asked for pings (and they are for us), else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2_000_000, 0.05)
    except ValueError:
        return None
