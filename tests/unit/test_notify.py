"""supervisor.daemon.notify in process:
what reaches a real datagram socket passed as NOTIFY_SOCKET."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from supervisor.daemon.notify import Notifier, watchdog_interval
from testkit import NotifyListener, wait_until


@pytest.fixture
def listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifyListener]:
    ear = NotifyListener()
    monkeypatch.setenv("NOTIFY_SOCKET", ear.address)
    try:
        yield ear
    finally:
        ear.close()


def received(ear: NotifyListener, n: int) -> list[str]:
    wait_until(lambda: len(ear.messages) >= n, 5.0, f"{n} datagrams")
    return [m for _, m in ear.messages]


def test_each_message_is_one_datagram(listener: NotifyListener) -> None:
    n = Notifier()
    assert n.enabled
    n.ready("ready (primary)")
    n.status("loading\n(primary)  - waiting")
    n.watchdog()
    n.extend_timeout(30.5)
    n.stopping("stopping")
    assert received(listener, 5) == [
        "READY=1\nSTATUS=ready (primary)",
        "STATUS=loading (primary) - waiting",  # one line: systemctl status shows only the first
        "WATCHDOG=1",
        "EXTEND_TIMEOUT_USEC=30500000",
        "STOPPING=1\nSTATUS=stopping",
    ]


def test_reloading_carries_the_monotonic_time(listener: NotifyListener) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    Notifier().reloading()
    (message,) = received(listener, 1)
    head, usec = message.split("\n")
    assert head == "RELOADING=1"
    assert usec.startswith("MONOTONIC_USEC=")
    assert before <= int(usec.removeprefix("MONOTONIC_USEC=")) <= before + 5_000_000


def test_silent_without_a_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled
    n.ready("ready")  # no socket: nothing to send to, and no error


def test_watchdog_interval_is_half_of_watchdog_sec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 0.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.setenv("WATCHDOG_USEC", "bogus")
    assert watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval() is None
