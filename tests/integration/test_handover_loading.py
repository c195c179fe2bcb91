"""A hand-over asked for while SGLang loads, with the real daemon and the stand-in: refused with
a clear answer (409, "try again once ready"), nothing counted, and systemd hears nothing early:
no RELOADING=1, and READY=1 only once the load's first decode succeeded. An internal error
during a load is not handed over either: the old path, SGLang stopped and exit 1."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest
import yaml

from supervisor.daemon import injected
from testkit import base_config, running, wait_gone, wait_until
from testkit.daemon import DaemonProcess, reaped
from testkit.notify import NotifyListener

pytestmark = pytest.mark.timeout(120)

REFUSED = (
    "the daemon hands over only while serving (ready, degraded, draining); it is loading: try "
    "again once ready, or use restart"
)


def said(listener: NotifyListener, field: str) -> list[float]:
    return [t for t, m in list(listener.messages) if field in m.split("\n")]


def test_during_a_load_it_is_refused_and_systemd_hears_no_early_ready(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, sglang={"env": {"STANDIN_LOAD_SECONDS": "3"}})
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    listener = NotifyListener()
    env = {**os.environ, "NOTIFY_SOCKET": listener.address}
    try:
        with reaped(DaemonProcess.start(path, cfg, env)) as d:
            d.wait_state("loading")
            r = d.post("/reexec")
            refused_at = time.monotonic()
            assert (r.status_code, r.json()) == (409, {"accepted": False, "error": REFUSED})
            d.wait_state("ready", timeout=30)
            st = d.status()
            assert st["daemon"]["handoffs"] == 0 and st["daemon"]["last_handoff"] is None
            assert 'kimi_serve_handoffs_total{outcome="failed"} 0.0' in d.get("/metrics").text
            # One READY=1, the start's, after the load's decode; no reload job was begun.
            ready = said(listener, "READY=1")
            assert len(ready) == 1 and ready[0] > refused_at, listener.messages
            assert said(listener, "RELOADING=1") == []
            # Once ready it is accepted, and systemd hears both (the listener sees them).
            assert d.post("/reexec").status_code == 202
            d.wait_for(lambda e: e.get("event") == "hand-over complete", 30, "hand-over")
            # Logged just before it is said.
            wait_until(lambda: len(said(listener, "READY=1")) == 2, 10, "the second READY=1")
            reloading, ready = said(listener, "RELOADING=1"), said(listener, "READY=1")
            assert len(reloading) == 1 and len(ready) == 2 and ready[0] < reloading[0] < ready[1]
            assert d.stop() == 0
    finally:
        listener.close()


def test_an_internal_error_during_a_load_is_not_handed_over(tmp_path: Path) -> None:
    fault = tmp_path / "internal-error"
    cfg = base_config(tmp_path, sglang={"env": {"STANDIN_LOAD_SECONDS": "30"}})
    with running(tmp_path, cfg, env={injected.ENV: str(fault)}) as d:
        d.wait_state("loading")
        procs = [psutil.Process(p) for p in d.status()["child"]["processes"]]
        fault.write_text("task")
        why = d.wait_for(
            lambda e: e.get("event") == "internal error not handed over", 30, "the refusal"
        )
        assert "it is loading" in why["why"]
        assert d.proc.wait(60) == 1
        assert not wait_gone(procs, timeout=10), "SGLang outlived the daemon"
        assert not any("hand-over: exec" in line for line in d.raw)
    incidents = list((tmp_path / "state" / "incidents").iterdir())
    assert [p.name.split("-", 1)[1] for p in incidents] == ["internal_error-launch1"]
