"""py-spy under the shipped unit, in a real systemd: the least privilege that lets the daemon's
py-spy (SGLang's sibling) dump SGLang, shown by taking it away piece by piece.

The box runs the unit as root (it has no `kimi` user); `SecureBits=noroot` takes away what root
alone would add, so capabilities behave as for the shipped non-root user: a process has only
what the unit's settings give it. The "SGLang" here is `stack_driver.py`'s two hung Python
processes; one is non-dumpable, which, like Yama's ptrace_scope=1 for a sibling (neither kernel
here has Yama), only CAP_SYS_PTRACE can trace.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.incidents.stacks import CAP_SYS_PTRACE, NO_PRIVILEGE
from testkit.box import Box
from testkit.systemd import UNIT_NAME, install_kimi_serve

DRIVER = Path(__file__).with_name("stack_driver.py")
PTRACE = 1 << CAP_SYS_PTRACE
AS_NON_ROOT = "SecureBits=noroot noroot-locked\n"


def run_driver(box: Box, extra: str) -> dict[str, Any]:
    install_kimi_serve(box, [box.python, DRIVER], extra=AS_NON_ROOT + extra)
    started = box.systemctl("start", UNIT_NAME, timeout=60)
    assert started.returncode == 0, box.journal(UNIT_NAME)
    out = box.run("cat", "/var/lib/kimi-serve/result.json", check=True).stdout
    box.systemctl("stop", UNIT_NAME, check=True, timeout=60)
    result: dict[str, Any] = json.loads(out)
    return result


@pytest.mark.systemd
def test_the_shipped_capability_lets_py_spy_dump_and_sglang_holds_none(box: Box) -> None:
    r = run_driver(box, "")
    # The daemon may hand CAP_SYS_PTRACE on (permitted + inheritable) and holds nothing else.
    assert r["daemon"]["CapBnd"] == PTRACE and r["daemon"]["CapPrm"] == PTRACE
    assert r["daemon"]["CapAmb"] == 0  # cleared by confine(): nothing it starts inherits it
    for kind in ("dumpable", "nondumpable"):
        assert r["targets"][kind]["CapPrm"] == 0 and r["targets"][kind]["CapAmb"] == 0, kind
        assert r["stacks"][kind]["error"] is None, r["stacks"][kind]["text"]
        assert r["stacks"][kind]["frame"], r["stacks"][kind]["text"]
    assert r["reason"] is None
    # The incident: in the unit's state directory, the service user's, mode 0700.
    assert r["incident"].startswith("/var/lib/kimi-serve/incidents/")
    assert r["incident_mode"] == "0o700" and r["incident_uid"] == r["uid"]


@pytest.mark.systemd
def test_without_the_capability_the_protected_process_has_no_stack_and_says_why(
    box: Box,
) -> None:
    r = run_driver(box, "CapabilityBoundingSet=\nAmbientCapabilities=\n")
    assert r["daemon"]["CapPrm"] == 0
    # Same user, dumpable, no capability on either side: the kernel allows it.
    assert r["stacks"]["dumpable"]["error"] is None
    # Non-dumpable (or a sibling under Yama): refused, and the capture knows why.
    assert r["stacks"]["nondumpable"]["error"] == NO_PRIVILEGE, r["stacks"]["nondumpable"]
    assert "Permission denied" in r["stacks"]["nondumpable"]["text"]


@pytest.mark.systemd
def test_the_ptrace_system_call_is_needed_too(box: Box) -> None:
    # The unit's filter without its `SystemCallFilter=ptrace` line: the capability alone is
    # not enough, py-spy cannot pause the process it dumps.
    filters = "SystemCallFilter=\nSystemCallFilter=@system-service pidfd_getfd\n"
    r = run_driver(box, filters + "SystemCallFilter=~@privileged\n")
    assert r["daemon"]["CapPrm"] == PTRACE
    assert {r["stacks"][k]["error"] for k in ("dumpable", "nondumpable")} == {NO_PRIVILEGE}, r
    assert r["reason"].startswith(NO_PRIVILEGE)
