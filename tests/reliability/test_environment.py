"""The host gets in the way: SGLang's port taken, the state directory unusable, the admin port
taken, the config file gone or unreadable at reload, the interpreter missing.

Each ends in a documented state with a message that names the thing and the fix, and never a
traceback in the daemon's own output (docs/reliability.md, "Environment faults").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit import BIN, base_config, kill_owned, owned_processes
from testkit.reliability import (
    MAX_WATCHDOG_GAP_S,
    is_event,
    is_state,
    operator_tracebacks,
    supervised,
    trial,
    write_config,
)

pytestmark = pytest.mark.timeout(90)


@contextmanager
def listening(port: int) -> Iterator[socket.socket]:
    """Another process's server on `port` (this test process, for the daemon's purposes)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    try:
        yield sock
    finally:
        sock.close()


def run_once(tmp: Path, cfg: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """`kimi-serve run` expected to give up by itself: its exit and output."""
    path = tmp / "kimi-serve.yaml"
    write_config(path, cfg)
    return subprocess.run(
        [str(BIN), "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sglang_port_taken_waits_in_cleaning_and_launches_once_freed(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    port = cfg["sglang"]["port"]
    with trial("environment faults", "SGLang port taken at launch") as t:
        holder = listening(port)
        holder.__enter__()
        try:
            with supervised(tmp_path, cfg, t) as run:
                waits = []
                for _ in range(3):  # it retries, saying why each time
                    ev = run.d.wait_for(
                        lambda e: (
                            e.get("event") == "state"
                            and e.get("new") == "cleaning"
                            and e.get("reason") == "host_not_ready"
                        ),
                        timeout=20,
                        what="a port-busy retry",
                    )
                    waits.append(ev)
                assert all(
                    str(port) in ev["detail"] and "sglang.port" in ev["detail"] for ev in waits
                ), waits
                st = run.status()
                assert st["state"] == "cleaning" and st["child"] is None
                # The retries are one entry of the history, counting them, not one each.
                retries = [e for e in st["events"] if e["reason"] == "host_not_ready"]
                assert len(retries) == 1 and retries[0]["count"] >= 3, st["events"]
                assert st["events"][-1]["reason"] == "host_not_ready"
                assert any(e["to"] == "cleaning" and e["from"] != "cleaning" for e in st["events"])
                assert str(port) in st["status_line"]
                # What `systemctl status` shows (any local user reads it) names the reason and
                # where the detail is, not the detail itself (docs/security.md).
                assert any(
                    "host_not_ready (detail: kimi-serve status)" in s for s in run.notify.statuses()
                ), run.notify.statuses()
                assert "launching" not in run.d.states()
                holder.__exit__(None, None, None)
                run.d.wait_for(is_state("launching"), timeout=20, what="the launch")
                run.d.wait_for(is_state("ready"), timeout=20, what="ready")
                gap = run.notify.max_watchdog_gap(until=time.monotonic())
                assert gap < MAX_WATCHDOG_GAP_S
                t.recovered = True
        finally:
            holder.__exit__(None, None, None)


def _clear_exit(r: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    out = r.stdout + r.stderr
    assert r.returncode == code, (r.returncode, out[-2000:])
    for needle in needles:
        assert needle in out, (needle, out[-2000:])
    assert not operator_tracebacks(out.splitlines()), out[-2000:]


def test_state_dir_unusable_exits_1_with_a_message(tmp_path: Path) -> None:
    blocker = tmp_path / "x" / "file"
    blocker.parent.mkdir()
    blocker.write_text("a regular file where a directory should be\n")
    cfg = base_config(tmp_path, state_dir=str(blocker / "sub"))
    with trial("environment faults", "state directory unusable") as t:
        r = run_once(tmp_path, cfg)
        t.tracebacks = len(operator_tracebacks((r.stdout + r.stderr).splitlines()))
        _clear_exit(r, 1, "state directory", str(blocker / "sub"), "state_dir")
        assert not owned_processes(str((blocker / "sub").resolve()))
        t.recovered = True  # a clear refusal is the documented outcome


def test_admin_port_taken_exits_1_naming_admin_listen(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    _host, port = cfg["admin"]["listen"].rsplit(":", 1)
    with trial("environment faults", "admin port taken") as t, listening(int(port)):
        r = run_once(tmp_path, cfg)
        t.tracebacks = len(operator_tracebacks((r.stdout + r.stderr).splitlines()))
        _clear_exit(r, 1, "admin.listen", port)
        # It gave up before launching anything.
        assert not owned_processes(str(Path(cfg["state_dir"]).resolve()))
        assert not (tmp_path / "launches").exists()
        t.recovered = True


def test_missing_interpreter_exits_78(tmp_path: Path) -> None:
    """preflight: a missing sglang.python is a config problem, which no restart fixes."""
    cfg = base_config(tmp_path, sglang={"python": "/nonexistent/python"})
    with trial("environment faults", "interpreter missing") as t:
        r = run_once(tmp_path, cfg)
        t.tracebacks = len(operator_tracebacks((r.stdout + r.stderr).splitlines()))
        _clear_exit(r, 78, "sglang.python", "/nonexistent/python")
        t.recovered = True


def _delete(path: Path) -> Callable[[], None]:
    def undo() -> None:
        pass

    path.unlink()
    return undo


def _directory(path: Path) -> Callable[[], None]:
    text = path.read_text()
    path.unlink()
    path.mkdir()

    def undo() -> None:
        path.rmdir()
        path.write_text(text)

    return undo


def _not_utf8(path: Path) -> Callable[[], None]:
    text = path.read_text()
    path.write_bytes(b"sglang:\n  port: \xff\xfe\n")

    def undo() -> None:
        path.write_text(text)

    return undo


def _unreadable(path: Path) -> Callable[[], None]:
    path.chmod(0)

    def undo() -> None:
        path.chmod(0o644)

    return undo


BREAK_CONFIG = {
    "deleted": _delete,
    "a directory": _directory,
    "not UTF-8": _not_utf8,
    "unreadable": _unreadable,
}


@pytest.mark.parametrize("how", sorted(BREAK_CONFIG))
def test_reload_of_a_broken_config_file_keeps_running(tmp_path: Path, how: str) -> None:
    if how == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads a file whatever its mode; 'a directory' covers a read error")
    cfg = base_config(tmp_path)
    with (
        trial("environment faults", f"config file {how} before SIGHUP") as t,
        supervised(tmp_path, cfg, t) as run,
    ):
        run.d.wait_state("ready")
        pid = run.status()["child"]["pid"]
        undo = BREAK_CONFIG[how](run.d.config_path)
        run.d.signal(signal.SIGHUP)
        ev = run.d.wait_for(is_event("reload refused"), timeout=10, what="the refusal")
        assert str(run.d.config_path) in " ".join(ev.get("errors", [])), ev
        st = run.status()
        assert st["state"] == "ready" and st["child"]["pid"] == pid
        # systemd is told the reload is over (READY=1 after RELOADING=1), or it waits forever.
        assert run.notify.count("RELOADING=1") == 1
        undo()
        if how != "deleted":
            run.d.signal(signal.SIGHUP)
            run.d.wait_for(
                is_event("reload: configuration unchanged"), timeout=10, what="the unchanged reload"
            )
        assert "restarting" not in run.d.states()
        t.recovered = True


def test_reload_never_stalls_the_loop_on_a_blocking_config_path(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    with (
        trial(
            "environment faults",
            "config path blocks on read (FIFO) at SIGHUP",
        ) as t,
        supervised(tmp_path, cfg, t) as run,
    ):
        run.d.wait_state("ready")
        path = run.d.config_path
        path.unlink()
        os.mkfifo(path)
        sent = time.monotonic()
        run.d.signal(signal.SIGHUP)
        try:
            # The loop must keep pinging systemd while the file blocks: 4 pings within 2.5 s.
            run.notify.wait_pings(after=sent, count=4, timeout=2.5)
            gap = run.notify.max_watchdog_gap(since=sent - 1.0, until=time.monotonic())
            t.notes["watchdog_gap_s"] = round(gap, 2)
            assert gap < MAX_WATCHDOG_GAP_S, f"the loop went {gap:.1f} s without a ping"
            t.recovered = True
        finally:
            # Unblock the reader (a writer that closes at once: an empty file), then clean up.
            threading.Thread(target=lambda: open(path, "w").close(), daemon=True).start()
            run.d.wait_for(is_event("reload refused"), timeout=10, what="the refusal")
            path.unlink()
            write_config(path, cfg)


def _poll_status(admin: str, cond: Callable[[dict[str, Any]], bool], timeout: float) -> bool:
    """Polls /status until `cond` holds (True) or the deadline passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond(httpx.get(admin + "/status", timeout=2, trust_env=False).json()):
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def test_losing_stdout_never_hides_a_dead_sglang(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    admin = f"http://{cfg['admin']['listen']}"
    path = tmp_path / "kimi-serve.yaml"
    write_config(path, cfg)
    proc = subprocess.Popen(
        [str(BIN), "run", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    owner = str(Path(cfg["state_dir"]).resolve())
    with trial(
        "environment faults",
        "daemon's stdout closed (log reader gone)",
    ) as t:
        try:
            assert _poll_status(admin, lambda s: s["state"] == "ready", 30)
            first = httpx.get(admin + "/status", trust_env=False).json()["child"]["pid"]
            assert proc.stdout is not None
            proc.stdout.close()  # whoever read the daemon's log is gone
            os.kill(first, signal.SIGKILL)
            recovered = _poll_status(
                admin,
                lambda s: (
                    s["restarts"].get("exited", 0) >= 1
                    and s["state"] == "ready"
                    and s["child"] is not None
                    and s["child"]["pid"] != first
                ),
                5,
            )
            st = httpx.get(admin + "/status", trust_env=False).json()
            t.false_ready = int(st["state"] == "ready" and st["child"] is None)
            assert recovered, f"SGLang died and the daemon still says {st['state']}: {st['child']}"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            t.recovered = True
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            kill_owned(owner)


def test_reload_to_a_missing_interpreter_is_refused(tmp_path: Path) -> None:
    """A reload gets the same preflight as a start: a missing interpreter makes the new
    config invalid, so the daemon keeps the running SGLang instead of trading it for a crash
    loop, and says why."""
    cfg = base_config(tmp_path)
    with (
        trial("environment faults", "interpreter missing after a reload") as t,
        supervised(tmp_path, cfg, t) as run,
    ):
        run.d.wait_state("ready")
        before = run.status()["child"]["pid"]
        good = dict(cfg["sglang"])
        cfg["sglang"]["python"] = "/nonexistent/python"
        write_config(run.d.config_path, cfg)
        run.d.signal(signal.SIGHUP)
        refused = run.d.wait_for(
            lambda e: e.get("event", "").startswith("reload refused"), what="the refusal"
        )
        assert any("/nonexistent/python" in line for line in refused["errors"]), refused
        st = run.status()
        assert st["state"] == "ready" and st["child"]["pid"] == before
        assert st["restarts"] == {}
        cfg["sglang"] = good
        write_config(run.d.config_path, cfg)
        run.d.signal(signal.SIGHUP)
        run.d.wait_for(lambda e: "unchanged" in e.get("event", ""), what="unchanged reload")
        t.recovered = True


def test_sigterm_while_waiting_for_a_busy_port(tmp_path: Path) -> None:
    """Stuck in `cleaning` (port taken): a stop is immediate and launches nothing."""
    cfg = base_config(tmp_path)
    with (
        trial("environment faults", "SIGTERM while the SGLang port is taken") as t,
        listening(cfg["sglang"]["port"]),
        supervised(tmp_path, cfg, t) as run,
    ):
        run.d.wait_for(
            lambda e: e.get("event") == "state" and e.get("reason") == "host_not_ready",
            timeout=20,
            what="a port-busy retry",
        )
        start = time.monotonic()
        run.d.signal(signal.SIGTERM)
        assert run.d.proc.wait(10) == 0
        assert time.monotonic() - start < 2.0
        assert "launching" not in run.d.states()
        assert not (tmp_path / "launches").exists()
        t.recovered = True
