"""The systemd baseline: systemd 252 itself, in the namespaced box of testkit/box.py,
running the stand-in as a `Type=exec` unit with `Restart=on-failure`.

That is what a unit without a readiness protocol gets: active (ready) as soon as the exec
succeeded, and a restart when the main process dies. systemd records when it noticed the
exit and left `active` (ActiveExitTimestamp), started the next process
(ExecMainStartTimestamp) and called the unit active again (ActiveEnterTimestamp), in
microseconds; `--timestamp=us+utc` prints them. (ExecMainExitTimestamp would be the natural
one, but it is cleared when the next process starts.)

The box has its own network namespace: the serving watcher runs inside it (nsenter).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.common import BenchError, wait_until


class Unavailable(Exception):
    """No box on this host; the message says why."""


def _stamp(value: str) -> float | None:
    """'Mon 2026-11-30 01:19:56.163032 UTC' -> unix seconds; '' or 'n/a' -> None."""
    if not value or value == "n/a":
        return None
    parsed = dt.datetime.strptime(value, "%a %Y-%m-%d %H:%M:%S.%f UTC")
    return parsed.replace(tzinfo=dt.UTC).timestamp()


class SystemdBox:
    def __init__(self, work: Path) -> None:
        try:
            from testkit.box import Box, BoxUnavailable
        except ImportError as exc:  # the harness is someone else's file; it may move
            raise Unavailable(f"testkit/box.py cannot be imported: {exc}") from None
        self.box = Box(work / "box")
        try:
            self.box.start()
        except BoxUnavailable as exc:
            raise Unavailable(str(exc)) from None
        except Exception as exc:
            self.box.stop()
            raise Unavailable(f"the box did not boot: {str(exc).splitlines()[0]}") from None

    @property
    def prefix(self) -> list[str]:
        """Run a command in the box's namespaces (same filesystem, the box's loopback)."""
        return ["nsenter", "-t", str(self.box.pid), "-a", "--"]

    def install(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], workdir: Path
    ) -> None:
        from testkit.box import exec_line

        lines = [
            "[Unit]",
            "Description=SGLang stand-in under plain systemd (bench baseline)",
            # The bench kills it over and over; a start rate limit would end the test, not
            # measure anything.
            "StartLimitIntervalSec=0",
            "[Service]",
            "Type=exec",
            f"ExecStart={exec_line(*argv)}",
            f"WorkingDirectory={workdir}",
            *(f'Environment="{k}={v}"' for k, v in env.items()),
            "Environment=PYTHONUNBUFFERED=1",
            "Restart=on-failure",
            # A stand-in with a hung request drains forever on SIGTERM, as SGLang does; the
            # bench's clean-up should not wait the default 90 s for the SIGKILL.
            "TimeoutStopSec=3s",
        ]
        self.box.install_unit(name, "\n".join(lines) + "\n")

    def start(self, name: str) -> None:
        done = self.box.systemctl("start", name)
        if done.returncode != 0:
            raise BenchError(f"systemctl start {name}: {done.stderr.strip()}")

    def stop_unit(self, name: str) -> None:
        self.box.systemctl("stop", name, timeout=60)

    def show(self, name: str, *props: str) -> dict[str, str]:
        args = [f"--property={p}" for p in props]
        done = self.box.systemctl("show", "--timestamp=us+utc", *args, name, check=True)
        return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)

    def times(self, name: str) -> dict[str, float | None]:
        stamps = ("ActiveEnterTimestamp", "ExecMainStartTimestamp", "ActiveExitTimestamp")
        raw = self.show(name, *stamps, "NRestarts")
        return {
            "active": _stamp(raw.get("ActiveEnterTimestamp", "")),
            "started": _stamp(raw.get("ExecMainStartTimestamp", "")),
            "noticed": _stamp(raw.get("ActiveExitTimestamp", "")),
            "restarts": float(raw.get("NRestarts", "0") or 0),
        }

    def main_host_pid(self, name: str) -> int:
        """The unit's main process as the host numbers it (for kill and pidfd)."""
        info = self.show(name, "MainPID", "ControlGroup")
        inner = int(info.get("MainPID", "0") or 0)
        group = info.get("ControlGroup", "")
        if not inner or not group or self.box.cgroup is None:
            raise BenchError(f"{name} has no main process")
        procs = (self.box.cgroup / group.lstrip("/") / "cgroup.procs").read_text().split()
        for pid in procs:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            nspid = next((ln for ln in status.splitlines() if ln.startswith("NSpid:")), "")
            if nspid.split()[-1:] == [str(inner)]:
                return int(pid)
        raise BenchError(f"main pid {inner} of {name} not found among {procs}")

    def wait_restarted(
        self, name: str, restarts_before: float, after: float, timeout: float
    ) -> dict[str, float | None]:
        """Times once systemd has restarted the unit and called it active again."""

        def done() -> dict[str, float | None] | None:
            t = self.times(name)
            ok = (t["restarts"] or 0.0) > restarts_before and (t["active"] or 0.0) > after
            return t if ok else None

        times: dict[str, float | None] = wait_until(done, timeout, 0.2, f"{name} restarted")
        return times

    def stop(self) -> list[str]:
        """Kill the box (everything inside dies with its PID 1); host changes, if any."""
        self.box.stop()
        try:
            return list(self.box.host_changes())
        except Exception:
            return []
