"""The box boots a real systemd, contained, and systemd treats units there as on a host.

Each behaviour kimi-serve relies on (READY gating, STATUS=, the journal,
EXTEND_TIMEOUT_USEC=, the watchdog, KillMode=mixed, RestartPreventExitStatus=) is
shown with a unit running tests/systemd/notifier.py, mostly next to a control case where the
outcome differs, so a harness that only pretended would fail.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from testkit.box import Box, HttpResult, exec_line, remove_cgroup, start_or_skip

pytestmark = pytest.mark.systemd

NOTIFIER = Path(__file__).with_name("notifier.py")


def notifier_unit(
    box: Box, *args: str, unit_type: str = "notify", settings: Sequence[str] = ()
) -> str:
    """A service running notifier.py with `args`, plus extra [Service] lines."""
    lines = [
        "[Unit]",
        "Description=kimi-box test unit",
        "[Service]",
        f"Type={unit_type}",
        f"ExecStart={exec_line(box.python, NOTIFIER, *args)}",
        *settings,
    ]
    return "\n".join(lines) + "\n"


def prop(box: Box, unit: str, name: str) -> str:
    return box.show(unit, name)[name]


def test_boot_is_fast_and_contained(box: Box) -> None:
    assert box.boot_seconds is not None and box.boot_seconds < 5
    assert box.run("cat", "/proc/1/comm").stdout.strip() == "systemd"
    assert box.systemctl("is-system-running").stdout.strip() == "running"
    assert box.systemctl("list-jobs", "--no-legend").stdout.strip() == ""
    # The distribution's units, whose boot jobs would act on the host, are not there.
    unit_files = box.systemctl("list-unit-files", "--no-legend").stdout
    assert "systemd-tmpfiles-setup.service" not in unit_files
    assert box.systemctl("cat", "systemd-sysctl.service").returncode != 0
    # Only its own loopback, up.
    links = box.run("ip", "-o", "link").stdout.splitlines()
    assert len(links) == 1 and ": lo:" in links[0] and ",UP," in links[0], links
    # Global kernel state is out of reach: tunables read-only, no kernel log device.
    tunable = box.run("sh", "-c", "echo 10 > /proc/sys/kernel/printk_ratelimit")
    assert tunable.returncode != 0 and "Read-only" in tunable.stderr
    assert box.run("test", "-e", "/dev/kmsg").returncode != 0
    # The box's cgroup namespace is rooted at its own subtree on the host.
    assert "0::/init.scope" in box.run("cat", "/proc/1/cgroup").stdout.splitlines()
    assert box.cgroup is not None and (box.cgroup / "init.scope").is_dir()


@pytest.mark.parametrize(("unit_type", "waits"), [("notify", True), ("simple", False)])
def test_start_returns_only_after_ready(box: Box, unit_type: str, waits: bool) -> None:
    marker = box.workdir / "ready-sent"
    box.install_unit(
        "late.service",
        notifier_unit(box, "--ready-after", "1", "--marker", str(marker), unit_type=unit_type),
    )
    started = time.monotonic()
    done = box.systemctl("start", "late.service")
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    # The marker is written just before READY=1: present iff start waited for it.
    assert marker.exists() is waits
    if waits:
        assert elapsed >= 1.0, elapsed
    assert prop(box, "late.service", "ActiveState") == "active"


def test_status_line_shows_in_systemctl_status(box: Box) -> None:
    box.install_unit("status.service", notifier_unit(box, "--status", "serving 3 requests"))
    box.systemctl("start", "status.service", check=True)
    status = box.systemctl("status", "status.service")
    assert 'Status: "serving 3 requests"' in status.stdout, status.stdout
    assert prop(box, "status.service", "StatusText") == "serving 3 requests"


def test_journal_has_the_units_output_and_systemds_lines(box: Box) -> None:
    box.install_unit("talk.service", notifier_unit(box, "--say", "hello from inside the box"))
    box.systemctl("start", "talk.service", check=True)
    box.wait_for(
        lambda: "hello from inside the box" in box.journal("talk.service"),
        what="the unit's stdout in `journalctl -u`",
    )
    assert "Started talk.service" in box.journal("talk.service")
    assert "hello from inside the box" not in box.journal("systemd-journald.service")


@pytest.mark.parametrize("extend", [True, False], ids=["extended", "not-extended"])
def test_extend_timeout_lets_a_start_outlast_timeout_start_sec(box: Box, extend: bool) -> None:
    args = ["--ready-after", "2.5"] + (["--extend-usec", "1000000"] if extend else [])
    box.install_unit("slow.service", notifier_unit(box, *args, settings=["TimeoutStartSec=1s"]))
    started = time.monotonic()
    done = box.systemctl("start", "slow.service", timeout=20)
    elapsed = time.monotonic() - started
    if extend:
        assert done.returncode == 0, done.stderr
        assert elapsed >= 2.5
        assert prop(box, "slow.service", "ActiveState") == "active"
    else:
        assert done.returncode != 0
        assert prop(box, "slow.service", "Result") == "timeout"


def test_watchdog_kills_a_stopped_process_and_restarts_it(box: Box) -> None:
    unit = "dog.service"
    box.install_unit(
        unit,
        notifier_unit(
            box,
            settings=[
                "WatchdogSec=1s",
                "Restart=on-failure",
                "RestartSec=100ms",
                # SIGABRT stays pending on a stopped process; SIGKILL follows after this.
                "TimeoutAbortSec=1s",
            ],
        ),
    )
    box.systemctl("start", unit, check=True)
    first_pid = prop(box, unit, "MainPID")
    first_ping = int(prop(box, unit, "WatchdogTimestampMonotonic"))
    # Its pings keep it alive well past one watchdog period.
    box.wait_for(
        lambda: int(prop(box, unit, "WatchdogTimestampMonotonic")) > first_ping + 1_500_000,
        what="a watchdog ping 1.5 s after the first",
    )
    assert prop(box, unit, "NRestarts") == "0"
    assert prop(box, unit, "MainPID") == first_pid

    def restarted() -> bool:
        state = box.show(unit, "NRestarts", "ActiveState", "MainPID")
        return (state["NRestarts"], state["ActiveState"]) == ("1", "active") and state[
            "MainPID"
        ] not in (first_pid, "0")

    box.run("kill", "-STOP", first_pid, check=True)
    box.wait_for(restarted, timeout=15, what="a restarted, active unit with a new main process")
    assert "Watchdog timeout" in box.journal(unit)


def test_stop_empties_the_units_cgroup(box: Box) -> None:
    unit = "family.service"
    child_pid_file = box.workdir / "child.pid"
    box.install_unit(
        unit,
        notifier_unit(
            box,
            "--child-pid-file",
            str(child_pid_file),
            settings=["KillMode=mixed", "TimeoutStopSec=20s"],
        ),
    )
    box.systemctl("start", unit, check=True)
    child = int(child_pid_file.read_text())
    main = int(prop(box, unit, "MainPID"))
    assert sorted(box.unit_pids(unit)) == sorted([main, child])
    control_group = prop(box, unit, "ControlGroup")

    started = time.monotonic()
    box.systemctl("stop", unit, check=True, timeout=30)
    elapsed = time.monotonic() - started

    assert box.unit_pids(unit) == []
    assert box.run("test", "-e", f"/sys/fs/cgroup{control_group}").returncode != 0
    assert box.run("test", "-e", f"/proc/{child}").returncode != 0
    # The child ignores SIGTERM; KillMode=mixed SIGKILLs it as soon as the main
    # process is gone instead of waiting out TimeoutStopSec.
    assert elapsed < 10, elapsed


@pytest.mark.parametrize(("status", "restarted"), [(78, False), (1, True)])
def test_exit_78_is_not_restarted(box: Box, status: int, restarted: bool) -> None:
    unit = "config.service"
    settings = ["Restart=on-failure", "RestartSec=100ms", "RestartPreventExitStatus=78"]
    box.install_unit(unit, notifier_unit(box, "--exit", str(status), settings=settings))
    assert box.systemctl("start", unit, timeout=30).returncode != 0
    if restarted:
        box.wait_for(lambda: int(prop(box, unit, "NRestarts")) >= 1, what="a restart")
    else:
        # `failed` (not `activating (auto-restart)`) means no restart is scheduled.
        state = box.show(unit, "ActiveState", "SubState", "NRestarts", "ExecMainStatus")
        assert state == {
            "ActiveState": "failed",
            "SubState": "failed",
            "NRestarts": "0",
            "ExecMainStatus": "78",
        }


def test_http_get_reaches_a_server_on_the_boxs_loopback(box: Box) -> None:
    www = box.workdir / "www"
    www.mkdir()
    (www / "index.html").write_text("served inside the box")
    server = exec_line(box.python, "-m", "http.server", "18080", "--directory", www)
    box.install_unit("web.service", f"[Service]\nExecStart={server} --bind 127.0.0.1\n")
    box.systemctl("start", "web.service", check=True)

    def answered() -> HttpResult | None:
        result = box.http_get("http://127.0.0.1:18080/")
        return result if result.status == 200 else None

    result = box.wait_for(answered, what="the server inside the box answering")
    assert result.body == "served inside the box"
    nothing = box.http_get("http://127.0.0.1:18081/")
    assert nothing.status is None and nothing.error and "refused" in nothing.error


def test_box_leaves_the_hosts_tmp_and_dev_alone(tmp_path: Path) -> None:
    """A unit writing /tmp (privately too), /dev/shm and /var/lib touches only the box."""
    box = Box(tmp_path / "box")
    start_or_skip(box)
    name = f"scribble-{box.name}"
    try:
        box.install_unit(
            "scribble.service",
            f"""
            [Service]
            Type=oneshot
            RemainAfterExit=yes
            PrivateTmp=yes
            ExecStart=/bin/sh -c 'for d in /tmp /var/tmp /dev/shm /var/lib; do echo x > $$d/{name}; done'
            """,  # noqa: E501
        )
        box.systemctl("start", "scribble.service", check=True)
        # Inside, the unit did write, and systemd made its private /tmp.
        private = box.run("sh", "-c", "ls -d /tmp/systemd-private-*-scribble.service-*")
        assert private.returncode == 0, private.stderr
        assert box.run("cat", f"/dev/shm/{name}").stdout == "x\n"
        assert box.run("cat", f"/var/lib/{name}").stdout == "x\n"
        for directory in ("/tmp", "/var/tmp", "/dev/shm", "/var/lib"):
            assert not (Path(directory) / name).exists()
        assert not list(Path("/tmp").glob("systemd-private-*scribble*"))
    finally:
        box.stop()
    assert box.host_changes() == []
    assert box.cgroup is not None and not box.cgroup.exists()


def test_a_box_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A test process killed before stop() leaves no systemd running behind it."""
    if os.geteuid() != 0:
        pytest.skip("no systemd box on this host: booting systemd in namespaces needs root")
    repo = Path(__file__).resolve().parents[2]
    driver_code = (
        "import sys\n"
        f"sys.path.insert(0, {str(repo)!r})\n"
        "from pathlib import Path\n"
        "from testkit.box import Box\n"
        "box = Box(Path(sys.argv[1])).start()\n"
        "print(box.pid, box.cgroup, box.name, flush=True)\n"
        "sys.stdin.read()\n"
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", driver_code, str(tmp_path / "box")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert driver.stdout is not None
    try:
        pid_text, cgroup, name = driver.stdout.readline().split()
        box_pidfd = os.pidfd_open(int(pid_text))
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    try:
        readable, _, _ = select.select([box_pidfd], [], [], 10)
        if not readable:
            signal.pidfd_send_signal(box_pidfd, signal.SIGKILL)
            select.select([box_pidfd], [], [], 10)
        assert readable, "the box's systemd outlived the process that started it"
    finally:
        os.close(box_pidfd)
        # stop() never ran: clean up what it would have.
        remove_cgroup(Path(cgroup))
        Path(f"/tmp/{name}.sentinel").unlink(missing_ok=True)
