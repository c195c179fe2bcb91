"""A stand-in for systemd's notify socket: what the daemon sends to $NOTIFY_SOCKET, timed."""

from __future__ import annotations

import itertools
import socket
import threading
import time
import uuid


class NotifyListener:
    """Receives what the daemon sends to $NOTIFY_SOCKET, with the time each datagram came."""

    def __init__(self) -> None:
        # An abstract socket: no path length limit, nothing to clean up on disk.
        self.address = f"@kimi-serve-reliability-{uuid.uuid4().hex[:16]}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.address[1:])
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []  # (monotonic, text)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode("utf-8", "replace")))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()

    def watchdog_times(self) -> list[float]:
        return [t for t, m in list(self.messages) if "WATCHDOG=1" in m.split("\n")]

    def max_watchdog_gap(self, since: float = 0.0, until: float | None = None) -> float:
        """The longest silence between WATCHDOG=1 pings after `since` (and up to `until`)."""
        times = [t for t in self.watchdog_times() if t >= since]
        if not times:
            return float("inf")
        points = [*times, until] if until is not None else times
        return max((b - a for a, b in itertools.pairwise(points)), default=0.0)

    def wait_pings(self, after: float, count: int, timeout: float) -> bool:
        """Whether `count` WATCHDOG=1 pings arrive after `after` within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while sum(t > after for t in self.watchdog_times()) < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def count(self, line: str) -> int:
        return sum(line in m.split("\n") for _, m in list(self.messages))

    def statuses(self) -> list[str]:
        return [
            part.removeprefix("STATUS=")
            for _, m in list(self.messages)
            for part in m.split("\n")
            if part.startswith("STATUS=")
        ]
