"""supervisor.incidents.recorder:
the daemon's hooks in the order a launch meets them, against a real hung
process and the real py-spy; restarts somebody asked for leave nothing."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor import config
from supervisor.incidents import stacks
from supervisor.incidents.recorder import IncidentRecorder
from testkit.incidents import Spawn


def make(tmp_path: Path, extra: str = "") -> IncidentRecorder:
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(
        "sglang:\n  model_path: /m\n  args: {crash-dump-folder: " + str(tmp_path / "dumps") + "}\n"
        f"state_dir: {tmp_path / 'state'}\nincidents: {{dump_timeout: 5s{extra}}}\n"
    )
    return IncidentRecorder(config.load(str(path)), wall=lambda: 1_795_000_000.0)


async def test_a_hang_is_recorded_with_its_stacks_and_load(
    tmp_path: Path, hung_child: Spawn
) -> None:
    rec = make(tmp_path)
    rec.launched(launch=4, profile="primary", mono_now=100.0)
    rec.line("[TP0] Load weight begin. avail mem=139.24 GB", 110.0)
    rec.line("[TP0] Load weight end. elapsed=300.00 s", 410.0)
    rec.port_open(450.0)
    rec.line("The server is fired up and ready to roll!", 470.0)
    rec.server_info({"version": "0.5.23", "tp_size": 1})
    # The passing probe took 2 s: it began before SGLang's ready line, so warmup ends there.
    phases = rec.probe_ok(471.0, latency_s=2.0)
    assert phases == {"init": 10.0, "weights": 300.0, "warmup": 19.0, "probe": 2.0}
    proc = hung_child()
    cap = await rec.before_kill("liveness_failed", [proc.pid])
    assert cap is not None and cap.ok
    w = rec.record("liveness_failed", "3 probes failed", None, 9, ["boom"], [{"index": 0}])
    assert w is not None and w.path is not None and rec.last_incident == w.path
    assert w.path.name == "20261118T110640Z-liveness_failed-launch4"
    doc = json.loads((w.path / "incident.json").read_text())
    assert doc["stacks"]["taken"] is True
    assert "wedged_in_all_reduce" in (w.path / "stacks.txt").read_text()
    assert doc["server_info"] == {"version": "0.5.23", "tp_size": 1}
    assert doc["config"]["digest"].startswith("sha256:")
    assert doc["timings"]["load_phases"]["weights"] == 300.0
    assert doc["timings"]["stack_dump_s"] is not None
    assert doc["crash_dump"]["folder"] == str(tmp_path / "dumps")
    assert rec.last_load is not None and rec.last_load["complete"] is True


async def test_an_exit_takes_no_dump_and_says_so(tmp_path: Path) -> None:
    calls: list[object] = []

    async def never(*args: object) -> None:
        calls.append(args)

    rec = make(tmp_path)
    rec._capture = never
    rec.launched(launch=1, profile="primary", mono_now=0.0)
    rec.line("[TP0] Load weight begin.", 5.0)
    assert await rec.before_kill("exited", [123]) is None
    w = rec.record("exited", "killed by signal 9", None, 9, [], [])
    assert calls == [] and w is not None and w.path is not None
    doc = json.loads((w.path / "incident.json").read_text())
    assert doc["stacks"]["taken"] is False
    assert doc["stacks"]["reason"].startswith(stacks.PROCESS_GONE)
    # A load that never finished: last_load says how far it got.
    assert rec.last_load == {
        "complete": False,
        "total_s": None,
        "phases": {"init": 5.0},
        "missing": ["weights", "kv_cache", "cuda_graph", "warmup", "probe"],
        "sglang_reported": {},
    }


def test_the_incident_keeps_server_info_without_the_key(tmp_path: Path) -> None:
    # SGLang 0.5.23's /server_info of a keyed server: the key in three places.
    key = "sk-live-0123456789abcdef"
    rec = make(tmp_path)
    rec.launched(launch=2, profile="primary", mono_now=0.0)
    rec.server_info(
        {
            "version": "0.5.23",
            "api_key": key,
            "admin_api_key": None,
            "launch_command": f"python -m sglang.launch_server --api-key {key} --port 30000",
            "internal_states": [{"api_key": key, "tp_size": 1}],
        }
    )
    w = rec.record("exited", "killed by signal 9", None, 9, [], [])
    assert w is not None and w.path is not None
    text = (w.path / "incident.json").read_text()
    assert key not in text
    info = json.loads(text)["server_info"]
    assert info["api_key"] == "<redacted>" and info["admin_api_key"] is None
    assert info["internal_states"] == [{"api_key": "<redacted>", "tp_size": 1}]
    assert "--api-key <redacted> --port 30000" in info["launch_command"]
    assert info["version"] == "0.5.23"


async def test_requested_restarts_leave_no_incident(tmp_path: Path) -> None:
    rec = make(tmp_path)
    rec.launched(launch=1, profile="primary", mono_now=0.0)
    for reason in ("manual", "reload"):
        assert rec.record(reason, "requested", 0, None, [], []) is None
    assert rec.store.entries() == []


async def test_a_capture_that_raises_never_stops_the_kill(tmp_path: Path) -> None:
    async def broken(*args: object) -> None:
        raise RuntimeError("py-spy exploded")

    rec = make(tmp_path)
    rec._capture = broken
    rec.launched(launch=2, profile="primary", mono_now=0.0)
    assert await rec.before_kill("fatal_log", [1]) is None
    w = rec.record("fatal_log", "Traceback", None, 9, [], [])
    assert w is not None and w.path is not None
    assert (
        "py-spy exploded" in json.loads((w.path / "incident.json").read_text())["stacks"]["reason"]
    )
