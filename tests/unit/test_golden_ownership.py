"""`sudo kimi-serve canary accept` writes into the service user's state directory: what root
writes there must stay the daemon's to read and replace (a real second user; root only)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor import cli
from supervisor.quality import Answer
from supervisor.quality.golden import CanaryStore, Golden
from testkit.gpu import SYSTEM_PYTHON
from testkit.users import system_user

SERVICE_USER = "kimi-serve-test"

# What the daemon needs of a golden, as the service user: to read it (json), and to replace it.
# Run by an interpreter the other user can run (the suite's may live under root's home).
_DAEMON = """
import json, os, sys
doc = json.load(open(sys.argv[1]))
tmp = sys.argv[1] + ".new"
with open(tmp, "w") as f:
    json.dump(doc, f)
os.replace(tmp, sys.argv[1])
print(json.dumps(doc["how"]))
"""


@pytest.fixture
def service() -> Iterator[tuple[int, int, Path]]:
    user = system_user(SERVICE_USER)
    top = Path(tempfile.mkdtemp(prefix="kimi-serve-golden-"))
    try:
        os.chmod(top, 0o755)
        state = top / "state"
        state.mkdir(mode=0o750)
        os.chown(state, user.pw_uid, user.pw_gid)
        yield user.pw_uid, user.pw_gid, state
    finally:
        shutil.rmtree(top)


def _as_daemon(uid: int, gid: int, golden: Path) -> str:
    done = subprocess.run(
        [SYSTEM_PYTHON, "-c", _DAEMON, str(golden)],
        user=uid,
        group=gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _received(uid: int, gid: int, canary: Path) -> None:
    """The daemon's last received answer, as the daemon leaves it: its directory, its file."""
    answer = Answer(" Paris", (5, 6), (4.0, 0.5), (7, 8))
    CanaryStore(str(canary)).save_last(
        Golden("k1", answer, "/m", "id", "0.5.23", "p", 16, 1.0, "received")
    )
    for p in (canary, canary / "last.json"):
        os.chown(p, uid, gid)


def test_a_golden_root_accepts_is_the_daemons_to_read(
    service: tuple[int, int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    uid, gid, state = service
    canary = state / "canary"
    _received(uid, gid, canary)
    cfg = state.parent / "k.yaml"
    cfg.write_text(f"sglang:\n  model_path: /m\nstate_dir: {state}\n")
    assert cli.main(["canary", "accept", "--config", str(cfg)]) == 0  # as root
    assert "accepted ' Paris'" in capsys.readouterr().out
    golden = canary / "golden-k1.json"
    st = golden.stat()
    assert (st.st_uid, st.st_gid) == (uid, gid) and st.st_mode & 0o077 == 0
    # The daemon holds its canary to the accepted golden, and can still replace it.
    assert json.loads(_as_daemon(uid, gid, golden)) == "accepted"


def test_a_canary_directory_root_makes_is_the_service_users(
    service: tuple[int, int, Path],
) -> None:
    uid, gid, state = service
    store = CanaryStore(str(state / "canary"))
    answer = Answer(" Paris", (5,), (1.0,), (7,))
    store.save_golden(Golden("k1", answer, "/m", "id", "0.5.23", "p", 16, 1.0, "accepted"))
    st = (state / "canary").stat()
    assert (st.st_uid, st.st_gid) == (uid, gid)
    assert json.loads(_as_daemon(uid, gid, state / "canary" / "golden-k1.json")) == "accepted"
