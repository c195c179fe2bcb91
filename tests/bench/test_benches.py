"""Every bench reachable from `python -m bench` and run in its quick, --standin or --simulated
form, so none breaks silently on a refactor. Each run checks that the bench did its steps and
said so (its exit status, its own checks, the rows it prints); the numbers are not judged here
(docs/benchmarks.md does, from full runs)."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import BENCHES, main

REPO = Path(__file__).resolve().parents[2]
# Modules that are parts of the comparison run (`python -m bench` itself), not benches.
PARTS = {
    "__init__",
    "__main__",
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


def bench(*args: str, timeout: float = 90) -> str:
    """`python -m bench ARGS` from the repository root; its stdout, asserting exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


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
@pytest.mark.parametrize("name", ["gpu-leftovers", "gpu-fitness", "gpu-multi"])
def test_gpu_bench_simulated(name: str, tmp_path: Path) -> None:
    quick = ["--quick"] if name != "gpu-multi" else []
    out = bench(name, "--simulated", *quick, "--out", str(tmp_path))
    doc = json.loads((tmp_path / f"{name.replace('-', '_')}.json").read_text())
    assert doc.get("simulated", doc.get("machine", {}).get("simulated")) is True
    if name == "gpu-leftovers":
        assert out.strip().endswith("PASS")
        kinds = {p["name"]: (p["classified"], p["alive_after"]) for p in doc["processes"]}
        assert kinds["foreign"] == ("foreign", True)
        assert all(k == "leftover" and not a for n, (k, a) in kinds.items() if n != "foreign")
        assert doc["blocked"]["rc"] == 1
    else:
        assert doc["checks"] and all(doc["checks"].values()), doc["checks"]
        assert "FAIL" not in out


@pytest.mark.slow
def test_real_sglang_rows_on_the_standin() -> None:
    out = bench("real-sglang", "--standin", "--rounds", "1")
    for row in (
        "launch_to_ready_s",
        "readiness_lag_from_port_s",
        "scheduler_kill_to_readyz_503_s",
        "scheduler_kill_to_ready_again_s",
        "readiness_lag_from_ready_line_s",
    ):
        assert re.search(rf"^{row} +-?[\d.]+ +-?[\d.]+$", out, re.M), out


@pytest.mark.slow
def test_downtime_on_the_standin(tmp_path: Path) -> None:
    out = bench(
        "downtime",
        "--standin",
        "--rounds",
        "1",
        "--only",
        "warm-off",
        "--json",
        str(tmp_path / "d"),
    )
    (row,) = json.loads((tmp_path / "d").read_text())["rounds"]
    assert row["prewarm"] == "off" and row["cold"] is False
    assert row["downtime_s"] > 0
    assert row["share"]["stop_and_backoff_s"] >= 0.5  # the backoff is inside it
    assert "| warm, prewarm off | restart |" in out


@pytest.mark.slow
def test_stack_dump() -> None:
    out = bench("stack-dump", "--tp", "1", "--rounds", "1", "--budget", "0.5")
    rows = [line for line in out.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert len(rows) == 3, out
    assert "hanging py-spy, 0.5 s budget" in rows[2]


@pytest.mark.slow
def test_profile_pump() -> None:
    out = bench("profile-pump", "--lines", "2000")
    assert "2000 lines of" in out
    for piece in ("scan (LogScanner.feed)", "LogPump.lines", "whole pump: pipe"):
        assert re.search(rf"^ +[\d.]+  {re.escape(piece)}", out, re.M), piece


@pytest.mark.slow
def test_slow_clients() -> None:
    out = bench("slow-clients", "--clients", "4", "--seconds", "1")
    (row,) = [line for line in out.splitlines() if line.startswith("| 4 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert int(cells[2]) > 0 and cells[3] == "0", row  # probes answered, none failed


@pytest.mark.slow
def test_multinode() -> None:
    out = bench("multinode", "--rounds", "1", "--quick", timeout=120)
    assert re.search(r"^follower SGLang +[\d.]+ \(max", out, re.M), out


@pytest.mark.slow
def test_incident_restart() -> None:
    out = bench("incident-restart", "--quick", timeout=120)
    assert re.search(r"^ +[\d.]+ median +\([\d.]+\) +real py-spy", out, re.M), out


@pytest.mark.slow
def test_fleet_smoke(tmp_path: Path) -> None:
    pytest.importorskip("sglang_router")
    bench("fleet", "--smoke", "--only", "router-2s", "--json", str(tmp_path / "f"), timeout=120)
    doc = json.loads((tmp_path / "f").read_text())
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
