"""The one kit for tests and benchmarks: real processes, real sockets, deadlines not sleeps.

- `free_port()`: a loopback port nobody listens on (bind port 0).
- `wait_until(predicate_or_event, timeout, what)`: a predicate polled, or an event waited on,
  against a deadline; AssertionError naming `what` when it does not come.
  `wait_until_async(predicate, timeout, what)` is the same for a coroutine.
- `NotifyListener`: a unix datagram socket standing in for systemd's $NOTIFY_SOCKET.
- `owned_processes`, `kill_owned`, `wait_gone(procs, timeout)`: process scans by the daemon's
  owner marker; `wait_gone` returns those still alive at the deadline.
- `base_config`, `running`, `DaemonProcess`, `BIN`: the real `kimi-serve run` as a process
  against the real stand-in, its JSON log lines on a queue.
- `testkit.box`: a real systemd booted in private namespaces.

Every helper the tests share is here, one module for what it holds (`testkit.standin`,
`testkit.machine`, `testkit.realsglang`, ...); no test imports another test module or a
conftest (tests/unit/test_testkit_imports.py checks).

Lives outside `tests/` so `bench/` can use it too; not part of the installed package.
"""

from testkit.daemon import BIN, DaemonProcess, base_config, running
from testkit.notify import NotifyListener
from testkit.procs import kill_owned, owned_processes, wait_gone
from testkit.wait import free_port, wait_until, wait_until_async

__all__ = [
    "BIN",
    "DaemonProcess",
    "NotifyListener",
    "base_config",
    "free_port",
    "kill_owned",
    "owned_processes",
    "running",
    "wait_gone",
    "wait_until",
    "wait_until_async",
]
