"""Every bench reachable from `python -m bench` and run in its quick, --standin or --simulated
form, so none breaks silently on a refactor. Each run checks that the bench did its steps and
said so (its exit status, its own checks, the rows it prints); the numbers are not judged here
(docs/benchmarks.md does, from full runs)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from bench import BENCHES
from bench.__main__ import main

REPO = Path(__file__).resolve().parents[2]
# Modules that are parts of the comparison run (`python -m bench` itself), not benches.
PARTS = {
    "__init__",
    "__main__",
    "compare",
    "common",
    "scenarios",
    "report",
    "kimi",
    "supervisord",
    "systemd_box",
    "poller",
    "observe",
    "flood",
    "loadgen",
}


# Each bench's suite form, started together (four at a time: they mostly wait on processes
# they started) the first time a test asks for one; each test then checks its own.
RUNS: dict[str, list[str]] = {
    "fleet": ["fleet", "--smoke", "--only", "router-2s", "--json", "{tmp}/fleet.json"],
    "multinode": ["multinode", "--rounds", "1", "--quick"],
    "gpu-leftovers": ["gpu-leftovers", "--simulated", "--quick", "--out", "{tmp}"],
    "incident-restart": ["incident-restart", "--quick"],
    "downtime": [
        *("downtime", "--standin", "--rounds", "1", "--only", "warm-off"),
        *("--json", "{tmp}/downtime.json"),
    ],
    "slow-clients": ["slow-clients", "--clients", "4", "--seconds", "1"],
    "real-sglang": ["real-sglang", "--standin", "--rounds", "1"],
    "stack-dump": ["stack-dump", "--tp", "1", "--rounds", "1", "--budget", "0.5"],
    "gpu-multi": ["gpu-multi", "--simulated", "--out", "{tmp}"],
    "profile-pump": ["profile-pump", "--lines", "2000"],
    "handoff": ["handoff", "--standin", "--rounds", "1", "--json", "{tmp}/handoff.json"],
}


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Any]]]:
    tmp = tmp_path_factory.mktemp("bench")
    if importlib.util.find_spec("sglang_router") is None:
        del RUNS["fleet"]
    with ThreadPoolExecutor(4) as pool:
        yield {
            name: pool.submit(_run, [a.format(tmp=tmp) for a in args])
            for name, args in RUNS.items()
        } | {"tmp": pool.submit(lambda: tmp)}


def bench(runs: dict[str, Future[Any]], name: str) -> tuple[str, Path]:
    """The bench's stdout (asserting exit 0) and the directory its files went to."""
    if name not in runs:
        pytest.skip(f"{name}: not available here")
    done = runs[name].result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, runs["tmp"].result()


def test_every_bench_module_is_a_subcommand() -> None:
    modules = {p.stem for p in (REPO / "bench").glob("*.py")}
    assert modules - PARTS == {m for m, _what in BENCHES.values()}


def test_no_bench_edits_sys_path() -> None:
    for path in (REPO / "bench").glob("*.py"):
        assert "sys.path" not in path.read_text(), path


def test_help_lists_every_bench_and_each_has_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    listing = capsys.readouterr().out
    for name, (module, _what) in BENCHES.items():
        assert re.search(rf"^  {re.escape(name)} ", listing, re.M), name
        # Importing it and parsing its --help: what a broken import would stop.
        importlib.import_module(f"bench.{module}")
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0, name
        assert f"python -m bench {name}" in capsys.readouterr().out


@pytest.mark.slow
def test_gpu_leftovers_simulated(runs: dict[str, Future[Any]]) -> None:
    out, tmp = bench(runs, "gpu-leftovers")
    doc = json.loads((tmp / "gpu_leftovers.json").read_text())
    assert doc["machine"]["simulated"] is True
    assert out.strip().endswith("PASS")
    kinds = {p["name"]: (p["classified"], p["alive_after"]) for p in doc["processes"]}
    assert kinds["foreign"] == ("foreign", True)
    assert all(k == "leftover" and not a for n, (k, a) in kinds.items() if n != "foreign")
    assert doc["blocked"]["rc"] == 1


@pytest.mark.slow
def test_gpu_multi_simulated(runs: dict[str, Future[Any]]) -> None:
    out, tmp = bench(runs, "gpu-multi")
    doc = json.loads((tmp / "gpu_multi.json").read_text())
    assert doc["simulated"] is True and len(doc["gpus"]) == 4
    assert doc["checks"] and all(doc["checks"].values()), doc["checks"]
    assert "FAIL" not in out


@pytest.mark.slow
def test_gpu_fitness_simulated(runs: dict[str, Future[Any]], tmp_path: Path) -> None:
    # Alone, after the others: it checks that event waits return on time.
    for run in runs.values():
        run.exception()
    done = _run(["gpu-fitness", "--simulated", "--quick", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_fitness.json").read_text())
    assert doc["machine"]["simulated"] is True
    assert doc["checks"] and all(doc["checks"].values()), doc["checks"]


@pytest.mark.slow
def test_real_sglang_rows_on_the_standin(runs: dict[str, Future[Any]]) -> None:
    out, _ = bench(runs, "real-sglang")
    for row in (
        "launch_to_ready_s",
        "readiness_lag_from_port_s",
        "scheduler_kill_to_readyz_503_s",
        "scheduler_kill_to_ready_again_s",
        "readiness_lag_from_ready_line_s",
    ):
        assert re.search(rf"^{row} +-?[\d.]+ +-?[\d.]+$", out, re.M), out


@pytest.mark.slow
def test_downtime_on_the_standin(runs: dict[str, Future[Any]]) -> None:
    out, tmp = bench(runs, "downtime")
    (row,) = json.loads((tmp / "downtime.json").read_text())["rounds"]
    assert row["prewarm"] == "off" and row["cold"] is False
    assert row["downtime_s"] > 0
    assert row["share"]["stop_and_backoff_s"] >= 0.5  # the backoff is inside it
    assert "| warm, prewarm off | restart |" in out


@pytest.mark.slow
def test_stack_dump(runs: dict[str, Future[Any]]) -> None:
    out, _ = bench(runs, "stack-dump")
    rows = [line for line in out.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert len(rows) == 3, out
    assert "hanging py-spy, 0.5 s budget" in rows[2]


@pytest.mark.slow
def test_profile_pump(runs: dict[str, Future[Any]]) -> None:
    out, _ = bench(runs, "profile-pump")
    assert "2000 lines of" in out
    for piece in ("scan (LogScanner.feed)", "LogPump.lines", "whole pump: pipe"):
        assert re.search(rf"^ +[\d.]+  {re.escape(piece)}", out, re.M), piece


@pytest.mark.slow
def test_slow_clients(runs: dict[str, Future[Any]]) -> None:
    out, _ = bench(runs, "slow-clients")
    (row,) = [line for line in out.splitlines() if line.startswith("| 4 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert int(cells[2]) > 0 and cells[3] == "0", row  # probes answered, none failed


@pytest.mark.slow
def test_multinode(runs: dict[str, Future[Any]]) -> None:
    out, _ = bench(runs, "multinode")
    assert re.search(r"^follower SGLang +[\d.]+ \(max", out, re.M), out


@pytest.mark.slow
def test_incident_restart(runs: dict[str, Future[Any]]) -> None:
    out, _ = bench(runs, "incident-restart")
    assert re.search(r"^ +[\d.]+ median +\([\d.]+\) +real py-spy", out, re.M), out


@pytest.mark.slow
def test_fleet_smoke(runs: dict[str, Future[Any]]) -> None:
    _, tmp = bench(runs, "fleet")
    doc = json.loads((tmp / "fleet.json").read_text())
    assert doc["not_measured"] == {}
    got = doc["router-2s"]
    assert set(got) == {"planned_restart", "broken", "hung"}
    assert got["planned_restart"]["sent"] > 0


def test_canary_figures() -> None:
    """canary and quality-canary need the real server for a run (minutes); here their
    figures, from answers made up to show each case."""
    from bench import canary

    ref = {"ids": [1, 2, 3], "logprobs": [-0.1, -0.2, -0.3], "margins": [1.0] * canary.TOKENS}
    same = dict(ref, cached_tokens=0)
    other = dict(ref, ids=[1, 9, 3], logprobs=[-0.15, -1.0, -0.3], cached_tokens=5)
    assert canary.first_diff([1, 2], [1, 2]) is None
    assert canary.first_diff([1, 2], [1, 3]) == 1
    assert canary.first_diff([1, 2], [1, 2, 3]) == 2
    assert canary.drift(other, ref) == pytest.approx(0.05)
    c = canary.condition([same, other], ref)
    assert (c["n"], c["texts_differing"], c["first_diff_positions"], c["cache_hits"]) == (
        2,
        1,
        [1],
        1,
    )


@pytest.mark.slow
def test_handoff_standin(runs: dict[str, Future[Any]]) -> None:
    out, tmp = bench(runs, "handoff")
    assert "hand-over vs restart on the stand-in" in out
    [r] = json.loads((tmp / "handoff.json").read_text())["rounds"]
    assert r["reexec"]["readyz_not_200"] == 0 and r["reexec"]["sglang_failed"] == 0
    assert r["restart"]["readyz_not_200"] > 0  # a restart is seen by the client; a hand-over not
