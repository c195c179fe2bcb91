"""kimi-serve under a real systemd, end to end: the shipped unit, the real daemon, the stand-in.

Each test boots a box (box.py), installs units/kimi-serve.service with the test drop-in
(testkit/systemd.py), points the daemon at the SGLang stand-in (testkit/daemon.py's
`base_config`) and drives it with systemctl, as an operator would. The box's systemd runs
at debug log level, so the journal holds every sd_notify message systemd accepted; the
tests read the order of events from there (journald's receive times) and from the daemon's
JSON log (its own timestamps), and wait on what systemd, the journal and /status say. The
one fixed wait is the window in which a unit that must not restart is watched.
See docs/systemd.md, "End-to-end tests".
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit import base_config
from testkit.box import Box
from testkit.systemd import (
    UNIT_NAME,
    JournalEntry,
    Notification,
    box_processes,
    daemon_events,
    descendants,
    enable_debug_log,
    install_kimi_serve,
    journal_entries,
    notifications,
)

pytestmark = pytest.mark.systemd

READY_STATUS = re.compile(r"^ready \(primary\) - probe \d+ ms$")


class Kimi:
    """kimi-serve.service in a box: its config file, its admin endpoint, its journal."""

    def __init__(self, box: Box, cfg: dict[str, Any]) -> None:
        self.box = box
        self.cfg = cfg
        self.config_path = box.workdir / "kimi" / "kimi-serve.yaml"
        self.write_config()

    def write_config(self) -> None:
        self.config_path.write_text(yaml.safe_dump(self.cfg))

    @property
    def admin(self) -> str:
        return f"http://{self.cfg['admin']['listen']}"

    def status(self) -> dict[str, Any]:
        """GET /status on the admin port, from inside the box."""
        got = self.box.http_get(f"{self.admin}/status")
        assert got.status == 200, got
        doc: dict[str, Any] = json.loads(got.body)
        return doc

    def status_with_sglang_tree(self) -> dict[str, Any]:
        """/status once the daemon knows the stand-in and its 4 children (tp 2, a detokenizer and
        multiprocessing's resource tracker, as real SGLang has: docs/sglang.md).

        It records the children as they appear, a poll at a time.
        """

        def complete() -> dict[str, Any] | None:
            status = self.status()
            child = status["child"]
            return status if child and len(child["processes"]) == 5 else None

        return self.box.wait_for(complete, what="the stand-in and its 4 children in /status")

    def show(self, *properties: str) -> dict[str, str]:
        return self.box.show(UNIT_NAME, *properties)

    def main_pid(self) -> int:
        return int(self.show("MainPID")["MainPID"])

    def entries(self) -> list[JournalEntry]:
        return journal_entries(self.box)

    def notifications(self) -> list[Notification]:
        """What systemd accepted from the daemon (NotifyAccess=main: only its main PID)."""
        return notifications(self.entries())

    def events(self) -> list[dict[str, Any]]:
        return daemon_events(self.entries())

    def start(self, timeout: float = 60) -> tuple[float, float]:
        """`systemctl start`, checked; returns (unix time before, unix time it returned)."""
        before = time.time()
        done = self.box.systemctl("start", UNIT_NAME, timeout=timeout)
        returned = time.time()
        assert done.returncode == 0, f"{done.stderr}\n{self.box.journal(UNIT_NAME)[-6000:]}"
        return before, returned


def kimi_serve(
    box: Box,
    *,
    env: dict[str, str] | None = None,
    extra: str = "",
    debug: bool = True,
    **overrides: Any,
) -> Kimi:
    """Install the shipped unit running `kimi-serve run` against the stand-in.

    `env`: more environment for the stand-in; `extra`: more [Service] lines for the test
    drop-in; `debug`: systemd at debug level, which logs every notification it accepts;
    `overrides`: config sections merged into base_config's. The state directory is the
    unit's own (StateDirectory=, $STATE_DIRECTORY), as in production.
    """
    work = box.workdir / "kimi"
    work.mkdir()
    cfg = base_config(work, **overrides)
    cfg["state_dir"] = None
    cfg["sglang"]["env"].update(env or {})
    kimi = Kimi(box, cfg)
    if debug:
        enable_debug_log(box)
    install_kimi_serve(
        box,
        [box.python.parent / "kimi-serve", "run", "--config", kimi.config_path],
        extra=extra,
    )
    return kimi


def state_changes(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["old"], e["new"]) for e in events if e["event"] == "state"]


def first(events: list[dict[str, Any]], what: str, **fields: Any) -> dict[str, Any]:
    """The first daemon log event named `what` with these fields."""
    for e in events:
        if e["event"] == what and all(e.get(k) == v for k, v in fields.items()):
            return e
    raise AssertionError(f"no {what} {fields} in the daemon's log: {state_changes(events)}")


def ready_notifications(kimi: Kimi) -> list[Notification]:
    return [n for n in kimi.notifications() if "READY=1" in n.fields]


def assert_ready_after_warming(kimi: Kimi, returned: float) -> None:
    """READY=1 reached systemd once, after a successful decode probe, before start returned."""
    events = kimi.events()
    ready = first(events, "state", old="warming", new="ready", reason="probe_ok")
    assert ready["_at"] < returned, "the daemon became ready only after start had returned"
    readies = ready_notifications(kimi)
    assert len(readies) == 1, readies
    assert readies[0].realtime > ready["_at"], "systemd got READY=1 before the probe succeeded"
    status = readies[0].get("STATUS")
    assert status is not None and READY_STATUS.match(status), readies[0]
    # systemd's own record: the daemon reported warming (the decode probe) before READY=1.
    said = [n.get("STATUS") or "" for n in kimi.notifications()]
    warming = next(i for i, s in enumerate(said) if s.startswith("warming"))
    assert warming < said.index(status), said


# ---------------------------------------------------------------------------------- start


def test_start_returns_after_a_served_decode(box: Box) -> None:
    kimi = kimi_serve(box, env={"STANDIN_LOAD_SECONDS": "2"})
    before, returned = kimi.start()

    # A READY=1 sent before the first decode (on the port, on /health) would have made
    # start return while the stand-in was still loading.
    assert returned - before >= 2.0
    status = kimi.status()
    assert status["state"] == "ready", status
    assert status["last_probe"]["ok"] is True and status["last_probe"]["kind"] == "readiness"
    assert status["last_probe"]["completion_tokens"] == 8
    assert status["child"]["launch"] == 1 and status["restarts"] == {}
    assert_ready_after_warming(kimi, returned)
    assert state_changes(kimi.events()) == [
        ("starting", "cleaning"),
        ("cleaning", "launching"),
        ("launching", "loading"),
        ("loading", "warming"),
        ("warming", "ready"),
    ]

    shown = kimi.show("ActiveState", "SubState", "StatusText", "MainPID", "NRestarts")
    assert (shown["ActiveState"], shown["SubState"], shown["NRestarts"]) == (
        "active", "running", "0",
    )  # fmt: skip
    assert READY_STATUS.match(shown["StatusText"]), shown
    text = box.systemctl("status", UNIT_NAME).stdout
    assert re.search(r'^\s+Status: "ready \(primary\) - probe \d+ ms"$', text, re.M), text
    # SGLang (the stand-in and its scheduler/detokenizer children) lives in the unit's cgroup,
    # under the daemon.
    main = int(shown["MainPID"])
    in_cgroup = set(box.unit_pids(UNIT_NAME))
    assert set(status["child"]["processes"]) | {main} <= in_cgroup
    assert in_cgroup == descendants(box_processes(box), main)


def test_a_load_longer_than_the_start_timeout_succeeds(box: Box) -> None:
    # TimeoutStartSec=5s, a 12 s load: only the daemon's EXTEND_TIMEOUT_USEC= (30 s, every
    # 10 s) lets the start job live long enough.
    load = 12.0
    kimi = kimi_serve(
        box,
        env={"STANDIN_LOAD_SECONDS": str(load)},
        extra="TimeoutStartSec=5s",
        readiness={"load_timeout": "60s"},
    )
    assert kimi.show("TimeoutStartUSec")["TimeoutStartUSec"] == "5s"
    before, returned = kimi.start(timeout=60)

    assert returned - before > load > 5
    shown = kimi.show("ActiveState", "SubState", "NRestarts", "Result")
    assert shown == {"ActiveState": "active", "SubState": "running", "NRestarts": "0",
                     "Result": "success"}  # fmt: skip
    assert kimi.status()["state"] == "ready"
    assert_ready_after_warming(kimi, returned)
    said = kimi.notifications()
    extensions = [n for n in said if n.get("EXTEND_TIMEOUT_USEC") is not None]
    assert {n.get("EXTEND_TIMEOUT_USEC") for n in extensions} == {"30000000"}, extensions
    # One right after start (within TimeoutStartSec), another 10 s later, both before READY.
    ready_at = ready_notifications(kimi)[0].realtime
    assert extensions[0].realtime - before < 5, extensions
    assert len([n for n in extensions if n.realtime < ready_at]) >= 2, extensions
    assert "start operation timed out" not in box.journal(UNIT_NAME)


def test_seed_incident_on_the_first_launch_is_not_reported_ready(box: Box) -> None:
    # Launch 1 is the incident's server: it loads, binds, passes /health, and dies on its
    # first real decode. `systemctl start` must wait through it for launch 2.
    kimi = kimi_serve(
        box,
        env={"STANDIN_FAULT": "seed-incident", "STANDIN_FAULT_LAUNCH": "1"},
    )
    counter = Path(kimi.cfg["sglang"]["env"]["STANDIN_LAUNCH_COUNTER"])
    _before, returned = kimi.start()

    status = kimi.status()
    assert status["state"] == "ready", status
    assert status["child"]["launch"] == 2, status["child"]
    assert counter.read_text().strip() == "2"
    restarts = status["restarts"]
    assert sum(restarts.values()) == 1, restarts
    assert set(restarts) <= {"fatal_log", "readiness_failed"}, restarts
    assert status["last_probe"]["ok"] is True

    events = kimi.events()
    changes = state_changes(events)
    # The broken launch got as far as the decode probe (so /health alone would have said
    # ready), and the restart came before the only `ready`.
    warming_1 = changes.index(("loading", "warming"))
    restarting = changes.index(("warming", "restarting"))
    assert warming_1 < restarting < changes.index(("warming", "ready"))
    assert changes.count(("warming", "ready")) == 1, changes
    restart = first(events, "sglang restart")
    assert restart["reason"] in restarts
    ready = first(events, "state", new="ready")
    assert restart["_at"] < ready["_at"] < returned
    readies = ready_notifications(kimi)
    assert len(readies) == 1 and readies[0].realtime > ready["_at"], readies
    said = [n.get("STATUS") or "" for n in kimi.notifications()]
    restart_said = next(i for i, s in enumerate(said) if s.startswith("restarting"))
    assert restart_said < said.index(readies[0].get("STATUS")), said


# ------------------------------------------------------------------------------- watchdog


def test_a_frozen_daemon_is_killed_by_the_watchdog_and_restarted(box: Box) -> None:
    kimi = kimi_serve(box, extra="WatchdogSec=3s\nRestartSec=500ms")
    kimi.start()
    old_main = kimi.main_pid()
    old_status = kimi.status_with_sglang_tree()
    old_processes = box_processes(box)
    old_sglang = {pid: old_processes[pid][1] for pid in old_status["child"]["processes"]}
    assert old_status["child"]["pid"] in old_sglang and len(old_sglang) == 5, old_status

    box.run("kill", "-STOP", str(old_main), check=True)

    def restarted() -> bool:
        shown = kimi.show("NRestarts", "ActiveState", "MainPID")
        return (shown["NRestarts"], shown["ActiveState"]) == ("1", "active") and (
            shown["MainPID"] not in ("0", str(old_main))
        )

    box.wait_for(restarted, timeout=30, interval=0.2, what="a restart after the watchdog")
    new_main = kimi.main_pid()
    status = kimi.status()
    assert status["state"] == "ready" and status["last_probe"]["ok"] is True, status

    journal = box.journal(UNIT_NAME)
    assert "Watchdog timeout (limit 3s)!" in journal
    assert f"Killing process {old_main} (kimi-serve) with signal SIGABRT." in journal
    assert "Failed with result 'watchdog'." in journal
    # PYTHONFAULTHANDLER=1 (the unit): the stuck daemon's threads are in the journal.
    assert "Fatal Python error: Aborted" in journal

    # Nothing of the old launch survives: not the frozen daemon, not its SGLang tree.
    processes = box_processes(box)
    survivors = [
        pid
        for pid, started in {old_main: old_processes[old_main][1], **old_sglang}.items()
        if pid in processes and processes[pid][1] == started
    ]
    assert survivors == [], survivors
    # The unit's cgroup holds the new daemon and its new SGLang, nothing else.
    in_cgroup = set(box.unit_pids(UNIT_NAME))
    assert in_cgroup == descendants(processes, new_main), (in_cgroup, new_main)
    assert set(status["child"]["processes"]) | {new_main} == in_cgroup


# ---------------------------------------------------------------------- stop and reload


def test_stop_is_clean_and_leaves_the_cgroup_empty(box: Box) -> None:
    kimi = kimi_serve(box)
    kimi.start()
    shown = kimi.show("ControlGroup", "MainPID")
    control_group = shown["ControlGroup"]
    pids = set(box.unit_pids(UNIT_NAME))
    assert len(pids) == 6, pids  # the daemon, the stand-in, 2 schedulers, a detokenizer, a tracker
    processes = box_processes(box)
    ours = {pid: processes[pid][1] for pid in pids}

    box.systemctl("stop", UNIT_NAME, check=True, timeout=60)

    assert kimi.show("ActiveState")["ActiveState"] == "inactive"
    # An inactive unit is garbage-collected at once (its properties reset): the journal keeps
    # how it ended.
    journal = box.journal(UNIT_NAME)
    assert "Main process exited, code=exited, status=0/SUCCESS" in journal, journal[-3000:]
    assert "Deactivated successfully." in journal
    assert box.unit_pids(UNIT_NAME) == []
    procs = box.run("cat", f"/sys/fs/cgroup{control_group}/cgroup.procs")
    assert procs.returncode != 0 or procs.stdout.strip() == "", procs
    processes = box_processes(box)
    assert [p for p, t in ours.items() if processes.get(p, (0, -1))[1] == t] == []

    # The daemon stopped SGLang itself (drain, then exit 0): systemd had nothing to kill.
    assert "Killing process" not in journal, journal[-3000:]
    stopping = [n for n in kimi.notifications() if "STOPPING=1" in n.fields]
    assert len(stopping) == 1, stopping
    changes = state_changes(kimi.events())
    assert changes[-2:] == [("ready", "stopping"), ("stopping", "stopped")], changes


def wait_active(kimi: Kimi) -> None:
    kimi.box.wait_for(
        lambda: (
            kimi.show("ActiveState", "SubState") == {"ActiveState": "active", "SubState": "running"}
        ),
        timeout=10,
        what="active (running)",
    )


def reload_notifications(kimi: Kimi, after: int) -> list[str]:
    """RELOADING=1 and READY=1 from the main PID, after the first `after` notifications."""
    said = kimi.notifications()[after:]
    return [f for n in said for f in n.fields if f in ("RELOADING=1", "READY=1")]


def test_reload_unchanged_does_nothing_and_changed_restarts_sglang(box: Box) -> None:
    kimi = kimi_serve(box)
    kimi.start()
    main = kimi.main_pid()
    first_child = kimi.status()["child"]

    # Unchanged: RELOADING=1, then READY=1; SGLang keeps running.
    seen = len(kimi.notifications())
    box.systemctl("reload", UNIT_NAME, check=True)
    box.wait_for(
        lambda: any(e["event"] == "reload: configuration unchanged" for e in kimi.events()),
        what="the daemon's reload log line",
    )
    box.wait_for(lambda: reload_notifications(kimi, seen) == ["RELOADING=1", "READY=1"],
                 what="RELOADING=1 then READY=1")  # fmt: skip
    wait_active(kimi)
    status = kimi.status()
    assert status["child"] == first_child and status["restarts"] == {}, status
    assert status["state"] == "ready"

    # Changed (an SGLang flag): RELOADING=1, READY=1, and SGLang restarts for reason `reload`.
    kimi.cfg["sglang"]["args"]["max-running-requests"] = 16
    kimi.write_config()
    seen = len(kimi.notifications())
    box.systemctl("reload", UNIT_NAME, check=True)
    box.wait_for(
        lambda: (s := kimi.status())["restarts"] == {"reload": 1} and s["state"] == "ready",
        timeout=20,
        what="a reload restart, ready again",
    )
    assert any(
        e["event"] == "reload: configuration changed, restarting SGLang" for e in kimi.events()
    )
    assert reload_notifications(kimi, seen)[:2] == ["RELOADING=1", "READY=1"]
    wait_active(kimi)
    status = kimi.status()
    assert status["child"]["launch"] == 2 and status["child"]["pid"] != first_child["pid"]
    assert status["last_restart"]["reason"] == "reload"
    argv = box.run("cat", f"/proc/{status['child']['pid']}/cmdline", check=True).stdout
    assert "--max-running-requests\x0016\x00" in argv
    # The daemon itself was not restarted: reload is not a restart of the unit.
    shown = kimi.show("MainPID", "NRestarts")
    assert (shown["MainPID"], shown["NRestarts"]) == (str(main), "0")


def test_a_sighup_while_loading_does_not_end_the_start_job(box: Box) -> None:
    """READY=1 only after the first decode probe, even when a SIGHUP comes first.

    `systemctl reload` waits for a running start job, but a SIGHUP can come from elsewhere
    (`kill -HUP $MAINPID`, what ExecReload= itself runs, from a config-management hook).
    systemd 252 takes any READY=1 as the end of the start job, so before the first ready the
    daemon answers a SIGHUP with STATUS= only.
    """
    kimi = kimi_serve(box, env={"STANDIN_LOAD_SECONDS": "4"}, readiness={"load_timeout": "60s"})
    box.systemctl("start", "--no-block", UNIT_NAME, check=True)
    box.wait_for(
        lambda: kimi.show("StatusText")["StatusText"].startswith("loading"),
        what="the daemon loading",
    )
    box.run("kill", "-HUP", str(kimi.main_pid()), check=True)
    line = box.wait_for(
        lambda: next(
            (e for e in kimi.events() if e["event"] == "reload: configuration unchanged"), None
        ),
        what="the daemon's reload log line",
    )
    # systemd handles one socket in order: once it logged a notification sent after the
    # reload line, it has acted on everything the daemon sent for the SIGHUP.
    box.wait_for(
        lambda: any(n.realtime > line["_at"] for n in kimi.notifications()),
        what="a notification after the reload",
    )
    status = kimi.status()
    assert status["state"] == "loading", status
    assert kimi.show("ActiveState")["ActiveState"] == "activating", ready_notifications(kimi)

    box.wait_for(
        lambda: kimi.show("ActiveState")["ActiveState"] == "active",
        timeout=30,
        what="active after the decode probe",
    )
    readies = ready_notifications(kimi)
    ready = first(kimi.events(), "state", old="warming", new="ready")
    assert len(readies) == 1 and readies[0].realtime > ready["_at"], readies


# -------------------------------------------------------------------------- bad config


def stays(box: Box, predicate: Any, seconds: float) -> None:
    """Fails if `predicate` ever turns false during `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate(), "changed during the observation window"
        time.sleep(0.1)


def test_a_bad_config_fails_with_78_and_is_not_restarted(box: Box) -> None:
    # RestartSec=200ms: a restart, if systemd scheduled one, would show within the window.
    # systemd at its normal log level: `journalctl -u` is what an operator reads.
    kimi = kimi_serve(box, extra="RestartSec=200ms", debug=False)
    kimi.cfg["readiness"]["load_timeout"] = "soon"
    kimi.write_config()

    done = box.systemctl("start", UNIT_NAME, timeout=30)
    assert done.returncode != 0

    def failed() -> bool:
        shown = kimi.show("ActiveState", "Result", "ExecMainStatus", "NRestarts")
        return shown == {"ActiveState": "failed", "Result": "exit-code",
                         "ExecMainStatus": "78", "NRestarts": "0"}  # fmt: skip

    box.wait_for(failed, timeout=10, what="failed with 78")
    stays(box, failed, 2.0)
    journal = box.journal(UNIT_NAME)
    assert "load_timeout" in journal and str(kimi.config_path) in journal, journal
    assert "Scheduled restart job" not in journal


def test_control_a_daemon_failure_other_than_config_is_restarted(box: Box) -> None:
    # The same settings, but a fatal error that is not the config's (exit 1): systemd
    # restarts it within the window, so the test above could see a restart.
    kimi = kimi_serve(box, extra="RestartSec=200ms", debug=False)
    not_a_directory = box.workdir / "kimi" / "state-is-a-file"
    not_a_directory.write_text("")
    kimi.cfg["state_dir"] = str(not_a_directory)
    kimi.write_config()

    box.systemctl("start", "--no-block", UNIT_NAME, check=True)
    box.wait_for(
        lambda: int(kimi.show("NRestarts")["NRestarts"]) >= 1, timeout=10, what="a restart"
    )
    journal = box.journal(UNIT_NAME)
    assert "Main process exited, code=exited, status=1/FAILURE" in journal, journal
    assert "Scheduled restart job" in journal


# ------------------------------------------------------------------------ admin token


_POST = """
import json, sys, urllib.error, urllib.request
url, token = sys.argv[1], sys.argv[2]
request = urllib.request.Request(url, method="POST", data=b"")
if token:
    request.add_header("Authorization", f"Bearer {token}")
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    with opener.open(request, timeout=5) as response:
        print(json.dumps({"status": response.status, "body": response.read().decode()}))
except urllib.error.HTTPError as error:
    print(json.dumps({"status": error.code, "body": error.read().decode()}))
"""


def test_the_admin_token_file_is_the_service_users_alone(box: Box) -> None:
    kimi = kimi_serve(box)
    kimi.start()
    main = kimi.main_pid()
    token_file = "/var/lib/kimi-serve/admin.token"
    # Created by the daemon at start, in the unit's StateDirectory=, 0600, owned by the
    # daemon's own (real and effective) user.
    shown = box.run("stat", "-c", "%a %u %g %F", token_file, check=True).stdout.split(None, 3)
    uid_line = box.run("grep", "^Uid:", f"/proc/{main}/status", check=True).stdout.split()
    assert shown[0] == "600" and shown[3].strip() == "regular file", shown
    assert shown[1] == uid_line[1] == uid_line[2], (shown, uid_line)
    directory = box.run("stat", "-c", "%a", "/var/lib/kimi-serve", check=True).stdout.strip()
    assert directory == "750"  # StateDirectoryMode=
    token = box.run("cat", token_file, check=True).stdout.strip()
    assert len(token) == 43

    def post(path: str, with_token: str) -> dict[str, Any]:
        done = box.run(box.python, "-c", _POST, f"{kimi.admin}{path}", with_token, check=True)
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    assert post("/restart", "")["status"] == 401
    assert post("/restart", "x" * 43)["status"] == 401
    assert kimi.status()["restarts"] == {}
    # The operator's command, as root in the box, finds the file from the same config.
    done = box.run(
        box.python.parent / "kimi-serve", "restart", "--config", kimi.config_path, timeout=30
    )
    assert done.returncode == 0, done.stderr
    box.wait_for(
        lambda: (s := kimi.status())["restarts"] == {"manual": 1} and s["state"] == "ready",
        timeout=20,
        what="the manual restart, ready again",
    )
    # Logged where it is, never what it is; the denials are in the journal. (The unit's
    # entries and the daemon's own: its first lines can precede its move into the cgroup.)
    journal = "\n".join(e.message for e in kimi.entries())
    assert token not in journal
    assert token_file in journal and "admin request denied" in journal
    # The unit is the same daemon: an admin restart restarts SGLang, not the unit.
    assert kimi.show("MainPID", "NRestarts") == {"MainPID": str(main), "NRestarts": "0"}


# ------------------------------------------------------------------------------- incidents


def _caps(box: Box, pid: int) -> dict[str, int]:
    text = box.run("cat", f"/proc/{pid}/status", check=True).stdout
    return {
        k: int(v.split()[0], 16)
        for k, _, v in (line.partition(":") for line in text.splitlines())
        if k.startswith("Cap")
    }


def test_a_hang_under_the_shipped_unit_leaves_stacks_and_sglang_holds_no_capability(
    box: Box,
) -> None:
    # As the shipped non-root user would: only what the unit gives (docs/systemd.md).
    kimi = kimi_serve(
        box,
        env={"STANDIN_FAULT": "decode-hang", "STANDIN_FAULT_LAUNCH": "1"},
        extra="SecureBits=noroot noroot-locked\n",
        debug=False,
        # Time to look at the launch before its first liveness probe hangs.
        liveness={"interval": "5s", "timeout": "1s", "failure_threshold": 2},
    )
    kimi.start()
    status = kimi.status()
    assert status["state"] == "ready" and status["child"]["launch"] == 1, status
    launch1 = status["child"]
    assert len(launch1["processes"]) >= 3, launch1  # main and two ranks at least
    ptrace = 1 << 19  # CAP_SYS_PTRACE
    daemon = _caps(box, kimi.main_pid())
    assert daemon["CapPrm"] == ptrace and daemon["CapInh"] == ptrace, daemon
    for pid in launch1["processes"]:  # SGLang inherits nothing (stacks.confine())
        caps = _caps(box, pid)
        assert caps["CapAmb"] == 0 and caps["CapPrm"] == 0 and caps["CapEff"] == 0, (pid, caps)

    def restarted() -> dict[str, Any] | None:
        status = kimi.status()
        last = status.get("last_restart")
        return status if last and status["child"] and status["child"]["launch"] == 2 else None

    status = box.wait_for(restarted, timeout=60, what="the liveness restart")
    last = status["last_restart"]
    assert last["reason"] == "liveness_failed", last
    inc = last["incident"]
    assert inc.startswith("/var/lib/kimi-serve/incidents/"), inc
    doc = json.loads(box.run("cat", f"{inc}/incident.json", check=True).stdout)
    assert doc["stacks"]["taken"] is True, doc["stacks"]
    dumped = {p["pid"] for p in doc["stacks"]["processes"] if p["ok"]}
    assert set(launch1["processes"]) <= dumped, doc["stacks"]
    assert "decode_step_hung" in box.run("cat", f"{inc}/stacks.txt", check=True).stdout
    shown = box.run("kimi-serve", "incidents", "show", "last", "--config", kimi.config_path)
    assert shown.returncode == 0 and "decode_step_hung" in shown.stdout, shown.stdout
    box.systemctl("stop", UNIT_NAME, check=True, timeout=60)
