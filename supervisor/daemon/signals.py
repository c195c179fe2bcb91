"""The signals the daemon takes, and what it does on those that ask nothing of it.

Every signal whose default action ends a process would end the daemon outright, and under the
unit (`KillMode=mixed`) SGLang with it: a full model load for one stray `kill -USR1`. So each
of them has a handler: SIGTERM and SIGINT stop, SIGHUP reloads (daemon/loop.py), SIGUSR1 dumps
the daemon's own stacks into the log, and the rest (`LOGGED`) are logged and otherwise ignored.
A handler, not SIG_IGN: an ignored signal stays ignored across exec, so SGLang would inherit
it, while a caught one is reset to SIG_DFL by the kernel's execve in every child.

Left as they are, on purpose: SIGABRT and the kernel's reports of an instruction or system call
gone wrong (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS: faulthandler, the watchdog; to
return from one is to run on); SIGPIPE and SIGXFSZ, which Python already ignores (a write then
fails with EPIPE or EFBIG) and `subprocess` restores to SIG_DFL for SGLang (restore_signals);
SIGKILL and SIGSTOP, which no process can catch, and the stop signals (SIGTSTP, SIGTTIN,
SIGTTOU), which stop rather than end (SIGCONT resumes; under the unit a daemon stopped past
`WatchdogSec=` is killed as a hung one). docs/security.md, "Signals", lists them all.

A storm is logged at most once a second per signal: the first at once, the rest of that second
counted into one line at its end. What is counted is what reached the loop: asyncio's wakeup
socket holds about 250 signals, and those sent faster than the loop reads it are dropped
(survived, not counted).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

STOP = (signal.SIGTERM, signal.SIGINT)
RELOAD = signal.SIGHUP
STACKS = signal.SIGUSR1
# Terminate (or dump core) by default, and nothing of the daemon's: logged, nothing else.
LOGGED: tuple[int, ...] = (
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGVTALRM,
    signal.SIGPROF,
    signal.SIGIO,  # = SIGPOLL
    signal.SIGQUIT,  # faulthandler does not take it; Ctrl-\ at a terminal
    signal.SIGXCPU,  # RLIMIT_CPU's soft limit
    signal.SIGSTKFLT,
    signal.SIGPWR,
    # The realtime signals, all of them: nothing in the daemon uses one. (glibc keeps the
    # two below SIGRTMIN for itself; no process may set their handlers.)
    *range(signal.SIGRTMIN, signal.SIGRTMAX + 1),
)
# Blocked across a hand-over's exec (daemon/handover.py): one that comes meanwhile waits for
# the new daemon's handlers instead of meeting SIG_DFL between the exec and their setting.
HANDLED = frozenset({*STOP, RELOAD, STACKS, *LOGGED})

EVERY_S = 1.0  # at most one line per signal this often
MAX_FRAMES = 40  # innermost frames of each thread in a stack dump


def name(sig: int) -> str:
    if signal.SIGRTMIN <= sig <= signal.SIGRTMAX:
        return "SIGRTMIN" if sig == signal.SIGRTMIN else f"SIGRTMIN+{sig - signal.SIGRTMIN}"
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def stacks() -> list[dict[str, Any]]:
    """Every thread's Python stack, innermost frame last."""
    threads = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        t = threads.get(ident)
        summary = traceback.extract_stack(frame)[-MAX_FRAMES:]
        out.append(
            {
                "thread": t.name if t is not None else "?",
                "id": ident,
                "daemon": t.daemon if t is not None else None,
                "stack": [
                    f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line}" if f.line else "")
                    for f in summary
                ],
            }
        )
    return out


@dataclass
class _Rate:
    last: float = float("-inf")  # when the last line for this signal was written
    pending: int = 0  # received since, not yet in a line
    flush: asyncio.TimerHandle | None = None


class Strays:
    """The handler of SIGUSR1 and of every signal in `LOGGED`."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self._rates: dict[int, _Rate] = {}

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (STACKS, *LOGGED):
            loop.add_signal_handler(sig, self.received, sig)
        # A storm faster than the loop reads fills asyncio's wakeup socket (about 250 signals):
        # the rest are dropped, and by default each drop printed a traceback on stderr.
        fd = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(fd, warn_on_full_buffer=False)

    def received(self, sig: int) -> None:
        loop = asyncio.get_running_loop()
        rate = self._rates.setdefault(sig, _Rate())
        rate.pending += 1
        now = loop.time()
        if now - rate.last >= EVERY_S:
            self._write(sig, rate, now)
        elif rate.flush is None:
            rate.flush = loop.call_at(rate.last + EVERY_S, self._flush, sig)

    def _flush(self, sig: int) -> None:
        rate = self._rates[sig]
        rate.flush = None
        if rate.pending:
            self._write(sig, rate, asyncio.get_running_loop().time())

    def _write(self, sig: int, rate: _Rate, now: float) -> None:
        count, rate.pending, rate.last = rate.pending, 0, now
        if sig == STACKS:
            self.log.warning("signal received", signal=name(sig), count=count, does="stacks")
            self.log.warning("daemon stacks", signal=name(sig), threads=stacks())
        else:
            self.log.warning("signal received", signal=name(sig), count=count, does="nothing")
