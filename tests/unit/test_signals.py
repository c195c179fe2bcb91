"""Which signals the daemon handles, which it leaves alone, the hand-over's mask, and the rate
limit on their log lines (supervisor/daemon/signals.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from supervisor.daemon import handover, signals

# signal(7): every signal whose default action is Term or Core.
ENDS_BY_DEFAULT = {
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGILL,
    signal.SIGTRAP,
    signal.SIGABRT,
    signal.SIGBUS,
    signal.SIGFPE,
    signal.SIGKILL,
    signal.SIGUSR1,
    signal.SIGSEGV,
    signal.SIGUSR2,
    signal.SIGPIPE,
    signal.SIGALRM,
    signal.SIGTERM,
    signal.SIGSTKFLT,
    signal.SIGXCPU,
    signal.SIGXFSZ,
    signal.SIGVTALRM,
    signal.SIGPROF,
    signal.SIGIO,
    signal.SIGPWR,
    signal.SIGSYS,
    *range(signal.SIGRTMIN, signal.SIGRTMAX + 1),
}
# Left as they are, each for its reason (docs/security.md, "Signals").
LEFT = {
    signal.SIGKILL,  # cannot be caught
    signal.SIGABRT,  # the watchdog's; faulthandler prints the stacks
    signal.SIGSEGV,
    signal.SIGBUS,
    signal.SIGFPE,
    signal.SIGILL,
    signal.SIGTRAP,
    signal.SIGSYS,
    signal.SIGPIPE,  # Python ignores them; subprocess restores them for SGLang
    signal.SIGXFSZ,
}


def test_every_signal_that_ends_a_process_is_handled_unless_left_on_purpose() -> None:
    assert signals.HANDLED == ENDS_BY_DEFAULT - LEFT
    assert signals.HANDLED.isdisjoint({signal.SIGSTOP, signal.SIGTSTP, signal.SIGCHLD})


def test_the_hand_over_blocks_every_handled_signal_across_its_exec() -> None:
    assert handover.SIGNALS == signals.HANDLED
    assert {signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGRTMAX} <= handover.SIGNALS
    assert {signal.SIGTERM, signal.SIGINT, signal.SIGHUP} <= handover.SIGNALS


def test_a_blocked_signal_waits_across_an_exec() -> None:
    # What the hand-over relies on: the mask and a pending signal survive execve, so a
    # SIGUSR1 sent meanwhile waits for the new program's handler instead of ending it.
    after = (
        "import os, signal, sys\n"
        "st = {l.split(':')[0]: int(l.split()[1], 16) for l in open('/proc/self/status')"
        " if l.startswith(('SigBlk', 'ShdPnd', 'SigPnd'))}\n"
        "bit = 1 << (signal.SIGUSR1 - 1)\n"
        "print(bool(st['SigBlk'] & bit), bool((st['ShdPnd'] | st['SigPnd']) & bit))\n"
    )
    before = (
        "import os, signal, sys\n"
        "from supervisor.daemon import handover\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, handover.SIGNALS)\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        f"os.execv(sys.executable, [sys.executable, '-c', {after!r}])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", before], capture_output=True, text=True, timeout=30, check=True
    )
    assert out.stdout.split() == ["True", "True"]


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append(("warning", event, kw))


def test_a_storm_is_one_line_a_window_with_the_rest_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(signals, "EVERY_S", 0.2)
    log = Log()
    strays = signals.Strays(log)

    async def storm() -> None:
        for _ in range(50):
            strays.received(signal.SIGUSR2)
        strays.received(signal.SIGRTMIN + 3)
        assert len(log.lines) == 2  # the first of each at once
        await asyncio.sleep(0.35)
        strays.received(signal.SIGUSR2)  # a new window
        await asyncio.sleep(0.35)

    asyncio.run(storm())
    got = [(e, kw["signal"], kw["count"]) for _, e, kw in log.lines]
    assert got == [
        ("signal received", "SIGUSR2", 1),
        ("signal received", "SIGRTMIN+3", 1),
        ("signal received", "SIGUSR2", 49),  # the rest of the first window, at its end
        ("signal received", "SIGUSR2", 1),
    ]


def test_sigusr1_dumps_every_threads_stack() -> None:
    log = Log()
    strays = signals.Strays(log)

    async def one() -> None:
        await asyncio.to_thread(lambda: None)  # a second thread, the executor's
        strays.received(signal.SIGUSR1)

    asyncio.run(one())
    (_, event, kw), (_, dump, stacks) = log.lines
    assert (event, kw["signal"], kw["does"]) == ("signal received", "SIGUSR1", "stacks")
    assert dump == "daemon stacks"
    threads = {t["thread"]: t for t in stacks["threads"]}
    assert "MainThread" in threads and len(threads) >= 2
    assert any("in one" in f for f in threads["MainThread"]["stack"])
    assert os.path.basename(__file__) in "".join(threads["MainThread"]["stack"])
