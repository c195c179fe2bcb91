"""The stand-in's decode hang for incident tests and the restart-time bench."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from testkit.daemon import DaemonProcess, base_config

HANG = {"STANDIN_FAULT": "decode-hang", "STANDIN_FAULT_LAUNCH": "1"}


def hang_config(tmp: Path, dump_timeout: str = "10s") -> dict[str, Any]:
    cfg = base_config(tmp, incidents={"dump_timeout": dump_timeout})
    cfg["sglang"]["env"].update(HANG)
    return cfg


def at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def restart_seconds(d: DaemonProcess) -> float:
    """From the daemon's decision to restart (`restarting`) to the launch gone (`cleaning`)."""
    begin = d.wait_state("restarting", 30)
    end = d.wait_state("cleaning", 30)
    return at(end) - at(begin)
