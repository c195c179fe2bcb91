"""Probe hygiene on both sides, real SGLang 0.5.23 on this CPU and the stand-in: timed-out
decode probes sent through the daemon's ProbeGate are aborted inside the server
(`POST /abort_request` with the probe's rid, docs/sglang.md), so its own
`sglang:num_running_reqs` returns to 0; the same probes without the abort stay running there
(the control). One server per side is shared by the module; the control runs last."""

from __future__ import annotations

import asyncio

import pytest

from supervisor.config import ProbeConfig
from testkit.conformance import Server
from testkit.probe_hygiene import (
    timed_out_probes_leave_nothing_running,
    unaborted_probes_keep_running,
)

pytestmark = pytest.mark.slow

# A decode far longer than the probe's timeout on either side: ~3000 tokens take 10 s or more
# on two cores (about 250 tokens/s), under the tiny model's 4096-token context.
LONG = ProbeConfig(
    endpoint="generate", prompt="Say hello", max_tokens=3000, timeout=0.5, expect_regex=None
)
COUNT = 3
# Shorter than SGLang's own check for a disconnected non-streaming client
# (SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s, docs/sglang.md): within it only the abort frees them.
SETTLE_S = 2.0


def test_timed_out_probes_are_aborted_inside_real_sglang(server: Server) -> None:
    out = asyncio.run(
        timed_out_probes_leave_nothing_running(
            server.url, LONG, count=COUNT, timeout=0.5, settle=SETTLE_S
        )
    )
    print(
        f"[{server.side}] aborted: running during {out.running_during}, after {out.running_after}, "
        f"settled in {out.settled_s}"
    )
    assert [r.reason for r in out.results] == ["timeout"] * COUNT, out.results
    assert all(r.aborted is True and r.rid for r in out.results), out.results
    assert len({r.rid for r in out.results}) == COUNT
    assert out.max_in_flight == 1
    assert out.running_after == 0, out


def test_without_the_abort_timed_out_probes_pile_up_in_real_sglang(server: Server) -> None:
    # The control: the same probes, no rid and no abort, all asked for at once; the client
    # gives up on them once the server runs one (not at a fixed 0.5 s: on a loaded machine
    # SGLang may not have started them by then, and a control that sees nothing proves nothing).
    out = asyncio.run(unaborted_probes_keep_running(server.url, LONG, count=COUNT))
    print(
        f"[{server.side}] not aborted: running during {out.running_during}, "
        f"after {out.running_after}"
    )
    assert out.running_during is not None, "the server never ran the probes"
    # Still decoding inside the server after the client gave up (the stand-in runs them all
    # at once; real SGLang's gauge may show the batch it runs).
    assert out.running_after is not None and out.running_after >= 1, out
    if server.side == "standin":
        assert out.running_after == COUNT, out
