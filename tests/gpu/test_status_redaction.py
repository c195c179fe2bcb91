"""What an unauthenticated `/status` tells about other users' GPU jobs: the real daemon on
simulated GPUs, another user's process (a real one, running as `nobody`) on a managed GPU with
a secret on its command line, and a client without the admin token on the real socket."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from supervisor.gpu.sim import ENV_GPUS, ENV_MIB, ENV_TAG
from testkit import base_config, running
from testkit.gpu import Procs

pytestmark = pytest.mark.timeout(90)

NOBODY = 65534
SECRET = "hunter2-" + uuid.uuid4().hex


@pytest.fixture
def neighbour(procs: Procs) -> Iterator[tuple[Procs, int]]:
    job = procs.start("train.py", "--hf-token", SECRET, "--sim-gpu", "0", user=NOBODY)
    yield procs, job.pid


def test_status_without_the_token_names_no_command_line_and_no_user(
    tmp_path: Path, neighbour: tuple[Procs, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    procs, pid = neighbour
    # 256 MiB per process: under the free threshold, so the daemon launches beside the job.
    env = {ENV_GPUS: "2", ENV_MIB: "256", ENV_TAG: procs.tag}
    cfg = base_config(tmp_path, gpus={"manage": True})
    with running(tmp_path, cfg, env=env) as d:
        d.wait_state("ready")
        open_doc = httpx.get(d.admin + "/status", timeout=5).json()
        whole = d.status()

    # With the token: the whole picture, for the operator.
    (mine,) = [p for p in whole["host"]["found"] if p["pid"] == pid]
    assert SECRET in mine["cmdline"] and mine["user"] == "nobody" and mine["kind"] == "foreign"
    # Without it: pid, program name, ours or not; nothing of the command line or the user.
    (seen,) = [p for p in open_doc["host"]["found"] if p["pid"] == pid]
    assert seen["name"] == "python3" and seen["ours"] is False and seen["kind"] == "foreign"
    text = json.dumps(open_doc)
    assert SECRET not in text and "train.py" not in text and "nobody" not in text
    assert {"cmdline", "user"} <= set(open_doc["redacted"])
