"""The hand-over under a real systemd (the shipped unit, the stand-in): `kimi-serve reexec`
keeps the unit's main PID and SGLang's processes, systemd sees RELOADING=1 then READY=1 from
the main PID, no restart is counted. And what the unit does today when the daemon is killed
outright (SIGKILL, the OOM killer): the whole cgroup goes, SGLang with it (docs/architecture.md,
"A daemon killed outright")."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import yaml

from testkit import base_config
from testkit.box import Box
from testkit.systemd import (
    UNIT_NAME,
    box_processes,
    daemon_events,
    enable_debug_log,
    install_kimi_serve,
    journal_entries,
    notifications,
)

pytestmark = [pytest.mark.systemd, pytest.mark.timeout(300)]


def _start(box: Box) -> tuple[dict[str, Any], str]:
    work = box.workdir / "kimi"
    work.mkdir()
    cfg = base_config(work)
    cfg["state_dir"] = None
    path = work / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    enable_debug_log(box)
    kimi = box.python.parent / "kimi-serve"
    install_kimi_serve(box, [kimi, "run", "--config", path], extra="RestartSec=200ms")
    done = box.systemctl("start", UNIT_NAME, timeout=60)
    assert done.returncode == 0, f"{done.stderr}\n{box.journal(UNIT_NAME)[-4000:]}"
    return cfg, str(path)


def _status(box: Box, cfg: dict[str, Any]) -> dict[str, Any]:
    got = box.http_get(f"http://{cfg['admin']['listen']}/status")
    assert got.status == 200, got
    doc: dict[str, Any] = json.loads(got.body)
    return doc


def _sglang_tree(box: Box, cfg: dict[str, Any]) -> dict[str, Any]:
    def complete() -> dict[str, Any] | None:
        child = _status(box, cfg)["child"]
        return child if child and len(child["processes"]) == 5 else None

    found: dict[str, Any] = box.wait_for(complete, what="the stand-in and its 4 children")
    return found


def test_reexec_keeps_the_main_pid_and_sglang_and_says_reloading_then_ready(box: Box) -> None:
    cfg, path = _start(box)
    main = box.show(UNIT_NAME, "MainPID")["MainPID"]
    child = _sglang_tree(box, cfg)
    before = len(notifications(journal_entries(box)))

    done = box.run(str(box.python.parent / "kimi-serve"), "reexec", "--config", path)
    assert done.returncode == 0, done.stderr

    def handed_over() -> bool:
        events = daemon_events(journal_entries(box))
        active = box.show(UNIT_NAME, "ActiveState")["ActiveState"] == "active"
        return active and any(e["event"] == "hand-over complete" for e in events)

    box.wait_for(handed_over, timeout=60, what="hand-over complete, the unit active")
    shown = box.show(UNIT_NAME, "MainPID", "NRestarts", "ActiveState")
    assert shown == {"MainPID": main, "NRestarts": "0", "ActiveState": "active"}
    status = _status(box, cfg)
    assert status["state"] == "ready" and status["child"]["pid"] == child["pid"]
    assert sorted(status["child"]["processes"]) == sorted(child["processes"])
    said = [
        f
        for n in notifications(journal_entries(box))[before:]
        if n.pid == int(main)
        for f in n.fields
        if f in ("RELOADING=1", "READY=1")
    ]
    assert said == ["RELOADING=1", "READY=1"], said


def test_a_daemon_killed_outright_takes_sglang_with_it(box: Box) -> None:
    # What the unit does today (KillMode=mixed, Restart=on-failure): the main process's death
    # stops the unit, and every process of its cgroup is killed; the next daemon launches anew.
    cfg, _ = _start(box)
    main = int(box.show(UNIT_NAME, "MainPID")["MainPID"])
    child = _sglang_tree(box, cfg)
    old = box_processes(box)
    killed_at = time.monotonic()
    box.run("kill", "-KILL", str(main), check=True)

    def sglang_gone() -> bool:
        now = box_processes(box)
        return not [p for p in child["processes"] if p in now and now[p][1] == old[p][1]]

    box.wait_for(sglang_gone, timeout=30, interval=0.05, what="the old SGLang gone")
    gone_after = time.monotonic() - killed_at
    box.wait_for(
        lambda: (
            box.show(UNIT_NAME, "NRestarts", "ActiveState")
            == {"NRestarts": "1", "ActiveState": "active"}
        ),
        timeout=60,
        what="the unit restarted and ready",
    )
    assert _status(box, cfg)["child"]["pid"] != child["pid"]
    print(f"\n[systemd] SIGKILL of the daemon -> its SGLang gone: {gone_after:.3f} s")
