"""The health-gated poller baseline: a small model of Kubernetes in front of SGLang.

    python -m bench.poller --port P [--period 10] [--timeout 1] [--failure-threshold 3]
                           [--relist 1] [--seed N] -- <server argv...>

What it models, with Kubernetes' defaults:
- readiness: GET /health every `--period` s (periodSeconds 10), `--timeout` s each
  (timeoutSeconds 1); ready on the first 200 (successThreshold 1), not ready after
  `--failure-threshold` failures in a row (failureThreshold 3). The probes of a launch start
  at a random phase within the period (seeded): a restarted container does not restart the
  probe ticker.
- restarts: the kubelet learns of a dead container on its next relist (`--relist`, 1 s, the
  PLEG period) and starts it again; the crash back-off (10 s, doubling) is left out, which only
  flatters the model.

It prints one JSON line per event with wall-clock times: `spawned` {pid}, `ready`,
`unready`, `died` {pid, code} (when noticed), `probe` {status}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import threading
import time

from bench.observe import emit, health_status


class Poller:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.rng = random.Random(a.seed)
        self.child: subprocess.Popen[bytes] | None = None
        self.launch = 0
        self.stop = threading.Event()

    def spawn(self) -> None:
        self.child = subprocess.Popen(self.a.argv, stdin=subprocess.DEVNULL, start_new_session=True)
        self.launch += 1
        emit("spawned", pid=self.child.pid, launch=self.launch)
        threading.Thread(target=self.probe_loop, args=(self.launch,), daemon=True).start()

    def probe_loop(self, launch: int) -> None:
        ready = False
        failures = 0
        next_at = time.monotonic() + self.rng.uniform(0, self.a.period)
        while not self.stop.is_set() and launch == self.launch:
            if self.stop.wait(max(0.0, next_at - time.monotonic())):
                return
            next_at += self.a.period
            if launch != self.launch:
                return
            status = health_status("127.0.0.1", self.a.port, self.a.timeout)
            emit("probe", status=status, launch=launch)
            if status == 200:
                failures = 0
                if not ready:
                    ready = True
                    emit("ready", launch=launch)
            else:
                failures += 1
                if ready and failures >= self.a.failure_threshold:
                    ready = False
                    emit("unready", launch=launch)

    def run(self) -> int:
        self.spawn()
        while not self.stop.wait(self.a.relist):
            assert self.child is not None
            code = self.child.poll()
            if code is not None:
                emit("died", pid=self.child.pid, code=code, launch=self.launch)
                self.spawn()
        return 0

    def shutdown(self, *_: object) -> None:
        self.stop.set()
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child.pid, signal.SIGKILL)
            self.child.wait()
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.poller",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--period", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=1.0)
    p.add_argument("--failure-threshold", type=int, default=3)
    p.add_argument("--relist", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("argv", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.argv[:1] == ["--"]:
        a.argv = a.argv[1:]
    if not a.argv:
        p.error("give the server's command line after --")
    poller = Poller(a)
    signal.signal(signal.SIGTERM, poller.shutdown)
    signal.signal(signal.SIGINT, poller.shutdown)
    return poller.run()


if __name__ == "__main__":
    raise SystemExit(main())
