"""Timed-out probes are aborted inside the server (POST /abort_request with the probe's rid),
against the stand-in; the same check runs against a real SGLang (testkit/probe_hygiene.py)."""

from __future__ import annotations

import asyncio

from supervisor.config import ProbeConfig
from testkit.probe_hygiene import timed_out_probes_leave_nothing_running
from testkit.standin import Launcher

HANG = {"STANDIN_FAULT": "decode-hang", "STANDIN_HANG_AFTER_DECODES": "0"}
CFG = ProbeConfig(
    endpoint="generate", prompt="Say hello", max_tokens=8, timeout=30.0, expect_regex=None
)


def test_timed_out_probes_are_aborted_and_nothing_stays_running(launch: Launcher) -> None:
    s = launch(env=HANG)
    out = asyncio.run(timed_out_probes_leave_nothing_running(s.url(""), CFG, count=3))
    assert [r.reason for r in out.results] == ["timeout"] * 3
    assert all(r.aborted is True and r.rid for r in out.results), out.results
    assert len({r.rid for r in out.results}) == 3
    assert out.max_in_flight == 1
    assert out.running_after == 0, out


def test_without_abort_the_probes_pile_up(launch: Launcher) -> None:
    # The control: the same timed-out probes with no rid and no abort stay running inside the
    # server, so the check above can fail.
    s = launch(env=HANG)
    out = asyncio.run(
        timed_out_probes_leave_nothing_running(s.url(""), CFG, count=3, settle=1.0, abort=False)
    )
    assert [r.reason for r in out.results] == ["timeout"] * 3
    assert out.running_after == 3, out


def test_chat_probe_is_aborted_too(launch: Launcher) -> None:
    s = launch(env=HANG)
    chat = ProbeConfig(
        endpoint="chat", prompt="Say hello", max_tokens=8, timeout=30.0, expect_regex=None
    )
    out = asyncio.run(timed_out_probes_leave_nothing_running(s.url(""), chat, count=2))
    assert all(r.aborted for r in out.results)
    assert out.running_after == 0, out
