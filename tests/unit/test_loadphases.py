"""supervisor.sglang.loadphases: SGLang 0.5.23's own load markers (as its logger prints them, rank
prefix included) into phases; phases a release does not print are absent, never 0."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from supervisor.metrics import Metrics
from supervisor.sglang.loadphases import PHASES, LoadTimeline

# model_runner.py:1274 / 1373, kv_cache_configurator.py:499, cuda_graph_setup.py:759 / 788,
# http_server.py:2600 (sglang 0.5.23); uvicorn's own start line.
TP0, TP1 = "[2026-12-01 10:00:00 TP0] ", "[2026-12-01 10:00:00 TP1] "
REAL_0_5_23 = [
    (12.0, TP0 + "Load weight begin. avail mem=139.24 GB"),
    (12.5, TP1 + "Load weight begin. avail mem=139.24 GB"),
    (
        300.0,
        TP1 + "Load weight end. elapsed=287.50 s, type=DeepseekV3ForCausalLM, avail mem=70.1 GB",
    ),
    (
        301.0,
        TP0 + "Load weight end. elapsed=289.00 s, type=DeepseekV3ForCausalLM, avail mem=70.1 GB",
    ),
    (340.0, TP0 + "Memory pool end. avail mem=25.30 GB"),
    (341.0, TP1 + "Memory pool end. avail mem=25.30 GB"),
    (342.0, TP0 + "Capture target verify CUDA graph begin. backend=fa3, num_tokens_per_req=4"),
    (420.0, TP1 + "Capture target verify CUDA graph end. bs=[1, 2, 4], elapsed=78.0 s"),
    (430.0, TP0 + "Capture draft decode CUDA graph begin. backend=fa3"),
    (450.0, TP0 + "Capture draft decode CUDA graph end. bs=[1, 2, 4], elapsed=20.0 s"),
    (470.0, "INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)"),
    (500.0, "[2026-12-01 10:08:20] The server is fired up and ready to roll!"),
    (510.0, TP0 + "Prefill batch, #new-seq: 1, #new-token: 6"),
    (600.0, TP0 + "Capture target verify CUDA graph begin. (a re-capture after load)"),
]


def feed(lines: list[tuple[float, str]], launched_at: float = 0.0) -> LoadTimeline:
    tl = LoadTimeline(launched_at)
    for t, line in lines:
        tl.feed(line, t)
    return tl


def test_every_phase_of_a_real_load() -> None:
    tl = feed(REAL_0_5_23[:10])
    tl.port_open(469.5)  # the daemon saw the port before uvicorn's line was read
    for t, line in REAL_0_5_23[10:]:
        tl.feed(line, t)
    tl.probe_ok(501.25, latency_s=0.5)  # SGLang said ready first: probe from its line
    assert tl.phases() == {
        "init": 12.0,
        "weights": 289.0,  # first rank's begin to the last rank's end
        "kv_cache": 40.0,
        "cuda_graph": 108.0,  # every capture, target and draft
        "warmup": 30.5,  # the port to SGLang's ready line
        "probe": 1.25,  # that line to the probe passing: our readiness lag, probe included
    }
    assert list(tl.phases()) == list(PHASES)
    doc = tl.document()
    assert doc["complete"] is True and doc["total_s"] == 501.25 and doc["missing"] == []


def test_phases_not_printed_are_absent_not_zero() -> None:
    # --disable-cuda-graph: no capture lines; a load that never got past the weights.
    lines = [(t, ln) for t, ln in REAL_0_5_23 if "graph" not in ln]
    tl = feed(lines)
    assert "cuda_graph" not in tl.phases()
    assert tl.document()["missing"] == ["cuda_graph", "probe"]
    partial = feed(REAL_0_5_23[:3])
    assert partial.phases() == {"init": 12.0, "weights": 288.0}
    assert partial.document()["complete"] is False and partial.document()["total_s"] is None


def test_older_release_wording() -> None:
    # Releases before 0.5.x (and the stand-in) print these.
    tl = feed(
        [
            (1.0, "[TP0] Load weight begin. avail mem=139.24 GB"),
            (5.0, "[TP0] Load weight end. type=DeepseekV3ForCausalLM"),
            (6.0, "[TP0] KV Cache is allocated. #tokens: 480000, KV size: 41.17 GB"),
            (7.0, "[TP0] Capture cuda graph begin. This can take up to several minutes."),
            (9.0, "[TP0] Capture cuda graph end. Time elapsed: 2.00 s."),
        ]
    )
    assert tl.phases() == {"init": 1.0, "weights": 4.0, "kv_cache": 1.0, "cuda_graph": 2.0}


def test_the_metric_has_only_the_phases_seen() -> None:
    m = Metrics()
    m.set_load_phases(feed(REAL_0_5_23).phases())
    m.set_load_phases({"weights": 10.0, "warmup": 2.0})  # the next launch printed fewer
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    samples = {s.labels["phase"]: s.value for s in fams["kimi_serve_load_phase_seconds"].samples}
    assert samples == {"weights": 10.0, "warmup": 2.0}


# A real SGLang 0.5.23 launch on a CPU (tiny Llama, --disable-cuda-graph), as kimi-serve's log
# recorded it (seconds after the launch). kimi-serve's probe passed 0.13 s after the port
# opened, while SGLang's own warm-up, queued behind other requests, said ready 58 s later.
REAL_CPU_RUN = [
    (14.379, "[2026-12-01 10:27:08] server_args={'model_path': '/work/cache/sglang-env/tiny'}"),
    (35.767, "[2026-12-01 10:27:29] Load weight begin. avail mem=20.76 GB"),
    (
        35.781,
        "[2026-12-01 10:27:29] Load weight end. elapsed=0.01 s, type=LlamaForCausalLM, "
        "avail mem=20.76 GB, mem usage=0.00 GB.",
    ),
    (
        36.400,
        "[2026-12-01 10:27:30] KV Cache is allocated. dtype: torch.float16, #tokens: 16384, "
        "K size: 0.00 GB, V size: 0.00 GB",
    ),
    (36.400, "[2026-12-01 10:27:30] Memory pool end. avail mem=20.75 GB"),
    (
        36.413,
        "[2026-12-01 10:27:30] Engine startup timings (s): load_weight=0.01, "
        "kv_cache_allocation=0.54, scheduler_e2e=2.13, cuda_graph={prefill=0.00, decode=0.00}, "
        "tokenizer_e2e=22.06",
    ),
    (36.435, "[2026-12-01 10:27:30] INFO:     Uvicorn running on http://127.0.0.1:31877"),
    (36.529, "[2026-12-01 10:27:30] Prefill batch, #new-seq: 1, cpu graph: False"),
]


def test_a_real_cpu_run_where_the_probe_beat_sglangs_warmup() -> None:
    # The probe that passed took 0.1 s, so it started 0.027 s after uvicorn's line: warmup
    # ends there (the server took requests), and SGLang's late ready line changes nothing.
    tl = feed(REAL_CPU_RUN)
    tl.probe_ok(36.562, latency_s=0.1)
    tl.feed("[2026-12-01 10:28:28] The server is fired up and ready to roll!", 94.163)
    assert tl.phases() == {
        "init": 35.767,
        "weights": 0.014,
        "kv_cache": 0.619,
        "warmup": 0.027,
        "probe": 0.1,
    }
    doc = tl.document()
    assert doc["missing"] == ["cuda_graph"]
    assert doc["sglang_reported"]["load_weight"] == 0.01
    assert doc["sglang_reported"]["kv_cache_allocation"] == 0.54


def test_warmup_ends_at_the_earlier_of_sglangs_line_and_the_passing_probe() -> None:
    # Probes refused while SGLang warms up (503, connection refused) count as warmup: it ends
    # where the probe that passed began, or at SGLang's line if that came first.
    cases = [
        # (ready line at, probe latency) -> (warmup, probe)
        (None, 2.0, (8.0, 2.0)),  # no ready line before the probe passed
        (9.0, 2.0, (8.0, 2.0)),  # the line came while the passing probe ran
        (6.0, 2.0, (5.5, 4.5)),  # the line first: probe = readiness lag
        (None, None, None),  # no latency known, no line: warmup cannot be placed
    ]
    for ready, latency, want in cases:
        tl = LoadTimeline(0.0)
        tl.port_open(0.5)
        if ready is not None:
            tl.feed("The server is fired up and ready to roll!", ready)
        tl.probe_ok(10.5, latency_s=latency)
        phases = tl.phases()
        if want is None:
            assert "warmup" not in phases and phases["probe"] == 10.0, phases
            missing = ["init", "weights", "kv_cache", "cuda_graph", "warmup"]
            assert tl.document()["missing"] == missing
        else:
            assert (phases["warmup"], phases["probe"]) == want, (ready, latency, phases)
            # Contiguous: together they are the port opening to decode-verified ready.
            assert phases["warmup"] + phases["probe"] == 10.0


def test_a_probe_that_seems_to_start_before_the_port_opened_gives_warmup_0_not_absent() -> None:
    # The probe is started by the port opening; a latency read on another clock path may put
    # its start a hair earlier. Warmup is then 0 (it did not delay serving), never negative.
    tl = LoadTimeline(0.0)
    tl.port_open(5.0)
    tl.probe_ok(5.2, latency_s=0.25)
    assert tl.phases() == {"warmup": 0.0, "probe": 0.2}
    tl.probe_ok(9.0, latency_s=0.0)  # a second success changes nothing: the load was over
    assert tl.phases() == {"warmup": 0.0, "probe": 0.2}
