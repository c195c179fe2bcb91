"""`sudo kimi-serve canary accept|show|forget` work in the service user's state directory: what
root writes there stays the daemon's to read and replace, and nothing the service user plants
there (a key naming another path, a link, a FIFO) makes root write, read or wait elsewhere.
A real second user; root only."""

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
from supervisor.quality.golden import CanaryStore, Golden, golden_key
from testkit.cli import kimi_serve
from testkit.gpu import SYSTEM_PYTHON
from testkit.users import system_user

SERVICE_USER = "kimi-serve-test"
KEY = golden_key("id", "0.5.23", "p", 16)

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


def _received(uid: int, gid: int, canary: Path, key: str = KEY) -> None:
    """The daemon's last received answer, as the daemon leaves it: its directory, its file.
    (`key` as the service user may have written it: last.json is its file.)"""
    canary.mkdir(mode=0o700)
    doc = Golden(
        KEY,
        Answer(" Paris", (5, 6), (4.0, 0.5), (7, 8)),
        "/m",
        "id",
        "0.5.23",
        "p",
        16,
        1.0,
        "received",
    ).to_json()
    (canary / "last.json").write_text(json.dumps({**doc, "key": key}))
    for p in (canary, canary / "last.json"):
        os.chown(p, uid, gid)


def _config(state: Path) -> str:
    cfg = state.parent / "k.yaml"
    cfg.write_text(f"sglang:\n  model_path: /m\nstate_dir: {state}\n")
    return str(cfg)


@pytest.fixture
def received(service: tuple[int, int, Path]) -> tuple[int, int, Path, str]:
    """The service user's canary directory with an answer received; root's config naming it."""
    uid, gid, state = service
    _received(uid, gid, state / "canary")
    return uid, gid, state / "canary", _config(state)


def test_a_golden_root_accepts_is_the_daemons_to_read(
    received: tuple[int, int, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    uid, gid, canary, config = received
    assert cli.main(["canary", "accept", "--yes", "--config", config]) == 0  # as root
    assert "accepted ' Paris'" in capsys.readouterr().out
    golden = canary / f"golden-{KEY}.json"
    st = golden.stat()
    assert (st.st_uid, st.st_gid) == (uid, gid) and st.st_mode & 0o077 == 0
    # The daemon holds its canary to the accepted golden, and can still replace it.
    assert json.loads(_as_daemon(uid, gid, golden)) == "accepted"
    assert [g.how for g in CanaryStore(str(canary)).goldens()] == ["accepted"]


def test_root_makes_no_directory_in_the_service_users_state(
    service: tuple[int, int, Path],
) -> None:
    _, _, state = service
    store = CanaryStore(str(state / "canary"))
    answer = Answer(" Paris", (5,), (1.0,), (7,))
    with pytest.raises(FileNotFoundError):
        store.save_golden(Golden(KEY, answer, "/m", "id", "0.5.23", "p", 16, 1.0, "accepted"))
    assert not (state / "canary").exists()


def test_a_key_naming_another_path_is_not_accepted(
    service: tuple[int, int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    uid, gid, state = service
    canary = state / "canary"
    _received(uid, gid, canary, key="x/../../../pwned")
    (canary / "golden-x").mkdir()
    assert cli.main(["canary", "accept", "--yes", "--config", _config(state)]) == 1
    assert "no canary answer received" in capsys.readouterr().err
    assert not (state.parent / "pwned.json").exists()
    assert sorted(p.name for p in canary.iterdir()) == ["golden-x", "last.json"]


def test_a_canary_directory_swapped_for_a_link_is_not_written_through(
    service: tuple[int, int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    uid, gid, state = service
    _received(uid, gid, state / "received")
    elsewhere = state.parent / "root-only"
    elsewhere.mkdir(mode=0o700)
    shutil.copy(state / "received" / "last.json", elsewhere / "last.json")
    (state / "canary").symlink_to(elsewhere)
    config = _config(state)
    assert cli.main(["canary", "accept", "--yes", "--config", config]) == 1
    assert cli.main(["canary", "forget", "--config", config]) == 1
    assert cli.main(["canary", "show", "--config", config]) == 0
    captured = capsys.readouterr()
    assert "Paris" not in captured.out and "Traceback" not in captured.err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["last.json"]
    assert elsewhere.stat().st_uid == 0


def test_a_fifo_or_a_link_for_last_json_is_no_answer(
    received: tuple[int, int, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, canary, config = received
    (canary / "last.json").unlink()
    os.mkfifo(canary / "last.json")  # a read that waited for a writer would never end
    assert cli.main(["canary", "show", "--config", config]) == 0
    assert cli.main(["canary", "accept", "--yes", "--config", config]) == 1
    (canary / "last.json").unlink()
    (canary / "last.json").symlink_to("/dev/zero")  # endless
    assert cli.main(["canary", "accept", "--yes", "--config", config]) == 1
    assert "no canary answer received" in capsys.readouterr().err


# Numbers the service user may write that Python's json takes and the reader then chokes on:
# NaN and Infinity (no JSON), 1e999 (infinite), 1e300 (finite, no date), a 401-digit integer
# (`math.isfinite` of it raises OverflowError). Each was `internal error: OverflowError` (or a
# ValueError) from root's `canary show` / `accept`.
_HOSTILE_NUMBERS = {
    "learned_at NaN": ('"learned_at": 1.0', '"learned_at": NaN'),
    "learned_at 1e300": ('"learned_at": 1.0', '"learned_at": 1e300'),
    "learned_at 1e999": ('"learned_at": 1.0', '"learned_at": 1e999'),
    "a margin of 401 digits": ('"margins": [4.0', '"margins": [' + "9" * 401),
    "max_tokens of 401 digits": ('"max_tokens": 16', '"max_tokens": ' + "9" * 401),
    "tokens_per_second Infinity": ('"tokens_per_second": null', '"tokens_per_second": Infinity'),
}

_WRITE_AS_SERVICE = """
import sys
open(sys.argv[1], "w").write(sys.argv[2])
"""


@pytest.mark.parametrize("what", list(_HOSTILE_NUMBERS))
def test_hostile_numbers_in_the_store_are_no_answer_for_roots_cli(
    received: tuple[int, int, Path, str], what: str
) -> None:
    uid, gid, canary, config = received
    text = (canary / "last.json").read_text()
    old, new = _HOSTILE_NUMBERS[what]
    assert old in text, text
    hostile = text.replace(old, new, 1)
    for name in ("last.json", f"golden-{KEY}.json"):  # written by the service user itself
        subprocess.run(
            [SYSTEM_PYTHON, "-c", _WRITE_AS_SERVICE, str(canary / name), hostile],
            user=uid,
            group=gid,
            extra_groups=[],
            check=True,
            timeout=60,
            cwd="/",
        )
    for action, code in (("show", 0), ("accept", 1)):
        done = kimi_serve("canary", action, "--config", config)  # never a traceback
        said = done.stdout + done.stderr
        assert "internal error" not in said, said
        assert done.returncode == code, said
    assert CanaryStore(str(canary)).last() is None and CanaryStore(str(canary)).goldens() == []
