"""The seed incident on the real SGLang 0.5.23 scheduler.

tests/realsglang/faulthook makes the real scheduler raise the incident's AttributeError on the
first decode batch of any request but SGLang's own warmup (recognised by its content): /health
and the warmup pass, as they did in
production, and SGLang prints its ready line. With SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1 (the
shipped config) the scheduler logs the traceback and SIGKILLs its whole process group. The
daemon must never report ready, and must restart with reason fatal_log and the traceback in
/status — not `exited` "killed by signal 9".
"""

from __future__ import annotations

import pytest

from testkit import realsglang as real
from testkit import wait_until
from testkit.realsglang import LOAD_TIMEOUT, alive_pids, daemon_config, real_daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

INCIDENT = "AttributeError: 'EAGLEWorkerV2' object has no attribute 'spec_disable_batch_threshold'"


def test_the_seed_incident_is_never_ready_and_restarts_as_fatal_log(
    sgl: real.SGLangEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("real-incident")
    cfg = daemon_config(tmp, sgl, env={"KIMI_TEST_FAULT": "decode-attributeerror"})
    with real_daemon(tmp, cfg) as r:
        r.d.wait_state("loading", 60)
        # Every process of the launch, once the daemon has recorded them all (main, resource
        # tracker, scheduler, detokenizer).
        wait_until(
            lambda: len(r.d.status()["child"]["processes"]) >= 4, LOAD_TIMEOUT, "workers", 0.05
        )
        launch = list(r.d.status()["child"]["processes"])
        restart = r.d.wait_for(
            lambda e: e.get("event") == "sglang restart", LOAD_TIMEOUT, "the first restart"
        )
        status = r.d.status()
        states = r.d.states()  # also takes in what arrived meanwhile
        # SGLang's port opened and answered (warming: our decode probe ran); we never said
        # ready. (SGLang's own ready line may or may not come: its warmup can share the batch
        # that crashes.)
        assert "ready" not in states and "warming" in states
        last = status["last_restart"]
        assert last["reason"] == "fatal_log", last
        assert INCIDENT in last["detail"]
        tail = "\n".join(last["log_tail"])
        assert "Scheduler hit an exception" in tail and INCIDENT in tail
        assert "Traceback (most recent call last)" in tail
        assert restart["reason"] == "fatal_log"
        # SGLang's killpg took the whole group down by signal 9; the restart says so too.
        assert (last["exit_code"], last["signal"]) == (None, 9)
        assert not alive_pids(launch)
