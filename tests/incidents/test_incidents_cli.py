"""`kimi-serve incidents [--json]` and `kimi-serve incidents show ID`, as on-call meets them:
the directory comes from the config, a real py-spy capture of a real hung process is shown with
its hung frame, and bad input is a message, never a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import cli
from supervisor.admin import status_command as status
from supervisor.incidents import Incident, IncidentStore
from supervisor.incidents.stacks import capture, innermost, parse
from testkit.incidents import TRACEBACK, Clock, Spawn, cfg, incident

KIMI_SERVE = Path(sys.executable).with_name("kimi-serve")


def write_config(tmp_path: Path, incidents_dir: Path) -> Path:
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(
        f"sglang: {{model_path: /models/m}}\nstate_dir: {tmp_path / 'state'}\n"
        f"incidents: {{dir: {incidents_dir}, keep: 5}}\n"
    )
    return path


@pytest.fixture
def populated(tmp_path: Path, hung_child: Spawn) -> tuple[Path, list[str]]:
    """Two incidents: an exit without stacks, then a hang with real py-spy stacks."""
    inc_dir = tmp_path / "incidents"
    store = IncidentStore(cfg(inc_dir), clock=Clock())
    exited = Incident(
        reason="exited",
        detail="killed by signal 9",
        launch=1,
        profile="primary",
        signal=9,
        log_tail=TRACEBACK,
        no_stacks_reason="process_gone: SGLang had exited; a dead process has no stack",
    )
    proc = hung_child()
    cap = asyncio.run(capture([proc.pid], timeout=10.0))
    assert cap.ok
    hang = Incident(**{**incident(launch=2).__dict__, "capture": cap, "log_tail": ["no output"]})
    names = [store.write(exited).path.name, store.write(hang).path.name]  # type: ignore[union-attr]
    return write_config(tmp_path, inc_dir), names


def test_list_newest_first(
    populated: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, (first, second) = populated
    assert cli.main(["incidents", "--config", str(config)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("2 incidents in ")
    assert out[1].split()[0] == second and out[2].split()[0] == first
    assert "no stacks" in out[2] and "AttributeError" in out[2]
    assert "stacks" in out[1].split()
    assert out[-1] == "details: kimi-serve incidents show ID"


def test_list_json(populated: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    config, (first, second) = populated
    assert cli.main(["incidents", "--json", "--config", str(config)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == [second, first]
    assert rows[1]["stacks"] is False and rows[1]["stacks_reason"].startswith("process_gone")
    assert rows[0]["reason"] == "liveness_failed" and rows[0]["launch"] == 2


def test_show_prints_the_summary_exception_and_hung_frame(
    populated: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, (first, second) = populated
    assert cli.main(["incidents", "show", second, "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"Incident {second}" in out
    assert (
        "liveness_failed  launch 2  profile primary  "
        "(stopped by kimi-serve: liveness_failed, signal 9)" in out
    )
    assert "Innermost frames, per process" in out
    assert "wedged_in_all_reduce" in out
    assert cli.main(["incidents", "show", first, "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "exception: AttributeError: 'EAGLEWorkerV2' object" in out
    assert "No stacks: process_gone" in out
    assert cli.main(["incidents", "show", "last", "--json", "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == second


def test_show_lists_only_the_files_there(
    populated: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, (first, _) = populated
    assert cli.main(["incidents", "show", first, "--config", str(config)]) == 0
    files = capsys.readouterr().out.splitlines()[-1]
    assert files == "Files: incident.json, log_tail.txt, stacks.txt (log_tail.txt: the traceback)"
    directory = config.parent / "incidents" / first
    (directory / "log_tail.txt").unlink()
    (directory / "stacks.txt").unlink()
    assert cli.main(["incidents", "show", first, "--config", str(config)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "Files: incident.json"


def test_show_unknown_and_missing_id(
    populated: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = populated
    assert cli.main(["incidents", "show", "nope", "--config", str(config)]) == 1
    assert "no incident 'nope'" in capsys.readouterr().err
    assert cli.main(["incidents", "show", "--config", str(config)]) == 2
    assert "which one?" in capsys.readouterr().err


def test_an_empty_or_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, tmp_path / "never-created")
    assert cli.main(["incidents", "--config", str(config)]) == 0
    assert "no incidents in" in capsys.readouterr().out


def test_the_installed_command_and_a_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("sglang: {model_path: /m}\nincidents: {keep: 0}\n")
    done = subprocess.run(
        [str(KIMI_SERVE), "incidents", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 78
    assert f"{bad}:2: incidents.keep: 0 is out of range" in done.stderr
    assert "Traceback" not in done.stderr


def test_status_names_the_last_incident() -> None:
    doc = {
        "state": "ready",
        "last_restart": {
            "reason": "liveness_failed",
            "at": 1.0,
            "signal": 9,
            "incident": "/var/lib/kimi-serve/incidents/20261201T031209Z-liveness_failed-launch4",
        },
    }
    doc["last_load"] = {
        "complete": True,
        "total_s": 612.4,
        "phases": {"init": 12.0, "weights": 289.0, "cuda_graph": 108.0},
    }
    text = status.render(doc, now=100.0)
    assert " Last load: 612 s (init 12 s, weights 289 s, cuda_graph 108 s)" in text
    assert (
        "Incident: /var/lib/kimi-serve/incidents/20261201T031209Z-liveness_failed-launch4" in text
    )
    assert "kimi-serve incidents show 20261201T031209Z-liveness_failed-launch4" in text


def _exited(launch: int) -> Incident:
    return Incident(
        reason="exited",
        detail="killed by signal 9",
        launch=launch,
        profile="primary",
        signal=9,
        log_tail=TRACEBACK,
        no_stacks_reason="process_gone: SGLang had exited; a dead process has no stack",
    )


@pytest.fixture
def four(tmp_path: Path) -> tuple[Path, list[str]]:
    """Four incidents without stacks, a minute apart: their ids share the year and more."""
    inc_dir = tmp_path / "incidents"
    store = IncidentStore(cfg(inc_dir), clock=Clock())
    names = [store.write(_exited(n)).path.name for n in range(1, 5)]  # type: ignore[union-attr]
    return write_config(tmp_path, inc_dir), names


def test_an_ambiguous_prefix_lists_the_candidates(
    four: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, names = four
    prefix = names[0][:4]
    assert all(n.startswith(prefix) for n in names)
    assert cli.main(["incidents", "show", prefix, "--config", str(config)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert f"{prefix!r} is ambiguous: 4 incidents" in lines[0]
    assert [ln.strip() for ln in lines[1:]] == sorted(names, reverse=True)
    # A prefix only one id has is still enough.
    assert cli.main(["incidents", "show", names[2][:-1], "--config", str(config)]) == 0
    assert f"Incident {names[2]}" in capsys.readouterr().out


def test_show_into_a_closed_pipe_exits_0_quietly(four: tuple[Path, list[str]]) -> None:
    """`kimi-serve incidents show last | head -1`, with the reader gone before the first write."""
    config, _ = four
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [str(KIMI_SERVE), "incidents", "show", "last", "--config", str(config)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


# ------------------------------------------------------- records the service user may have written


@pytest.mark.parametrize(
    ("name", "how"),
    [
        ("deep", "nested"),  # 16,000 `[`: RecursionError in json.loads
        ("stacks-list", "stacks: []"),
        ("exception-int", "exception: 5"),
        ("huge", "8 MiB of JSON"),
        ("link", "a link to another file"),
        ("dir-link", "the incident directory a link"),
        ("fifo", "stacks.txt a FIFO"),
    ],
)
def test_a_hostile_record_is_one_unreadable_row_and_never_stops_the_listing(
    four: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str], name: str, how: str
) -> None:
    config, names = four
    target = config.parent / "incidents" / names[1] / "incident.json"
    doc = json.loads(target.read_text())
    target.unlink()
    secret = config.parent / "root-only.json"
    secret.write_text(json.dumps({**doc, "detail": "from a file root alone may read"}))
    if how == "nested":
        target.write_text("[" * 16_000)
    elif how == "stacks: []":
        target.write_text(json.dumps({**doc, "stacks": []}))
    elif how == "exception: 5":
        target.write_text(json.dumps({**doc, "exception": 5, "detail": {"x": 1}}))
    elif how == "8 MiB of JSON":
        target.write_text(json.dumps({**doc, "detail": "x" * (8 << 20)}))
    elif how == "a link to another file":
        target.symlink_to(secret)
    elif how == "the incident directory a link":
        elsewhere = config.parent / "root-only"
        elsewhere.mkdir()
        (elsewhere / "incident.json").write_text(secret.read_text())
        shutil.rmtree(target.parent)
        target.parent.symlink_to(elsewhere)
    else:
        # Stacks said taken; a read of stacks.txt that waited for a writer would never end.
        target.write_text(json.dumps({**doc, "stacks": {"taken": True, "seconds": 0.1}}))
        (target.parent / "stacks.txt").unlink(missing_ok=True)
        os.mkfifo(target.parent / "stacks.txt")
    assert cli.main(["incidents", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in names)
    assert "from a file root alone may read" not in out
    assert cli.main(["incidents", "--json", "--config", str(config)]) == 0
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert all(rows[n].get("error") is None for n in names if n != names[1])
    if how in (
        "nested",
        "8 MiB of JSON",
        "a link to another file",
        "the incident directory a link",
    ):
        assert rows[names[1]]["error"].startswith("unreadable: ")
    else:
        assert rows[names[1]].get("error") is None
        assert rows[names[1]]["stacks"] is (how == "stacks.txt a FIFO")
    # `show` of it: a line saying what is wrong, exit 1, or the incident; never a traceback.
    code = cli.main(["incidents", "show", names[1], "--config", str(config)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert "from a file root alone may read" not in captured.out
    if how in ("stacks: []", "exception: 5", "stacks.txt a FIFO"):
        assert code == 0 and f"Incident {names[1]}" in captured.out
    else:
        assert code == 1 and captured.err.count("\n") >= 1


def test_show_reads_no_stacks_through_a_link(
    four: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    config, names = four
    d = config.parent / "incidents" / names[0]
    doc = json.loads((d / "incident.json").read_text())
    doc["stacks"] = {"taken": True, "seconds": 0.1}
    (d / "incident.json").write_text(json.dumps(doc))
    secret = config.parent / "shadow"
    secret.write_text(
        '=== pid 7: sglang::scheduler ===\nThread 7 (active): "MainThread"\n'
        "    secret-line (x.py:1)\n"
    )
    (d / "stacks.txt").unlink(missing_ok=True)
    (d / "stacks.txt").symlink_to(secret)
    # Through a link: shown as a plain file would be (the check on the check).
    (d / "plain").write_text(secret.read_text())
    assert "secret-line" in "\n".join(
        line for dump in parse((d / "plain").read_text()) for line in innermost(dump)
    )
    assert cli.main(["incidents", "show", names[0], "--config", str(config)]) == 0
    assert "secret-line" not in capsys.readouterr().out
