"""What an idle, healthy server answers: the stand-in and real SGLang 0.5.23 must agree.

Each test states one property kimi-serve relies on and checks it on both sides (the `side`
parameter); a failure names the side, so after an SGLang upgrade the real column shows what
changed. The expectations are real SGLang's, read from its 0.5.23 source (docs/sglang.md,
"Observed on the real server (CPU)").
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.conformance import Server, titled

pytestmark = pytest.mark.slow

GET_ENDPOINTS = (
    "/health",
    "/health_generate",
    "/server_info",
    "/get_server_info",
    "/model_info",
    "/get_model_info",
    "/metrics",
)
# The meta_info keys kimi-serve's probe reads, present on every finished /generate.
META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "num_retractions",
    "weight_version",
    "e2e_latency",
}
SPEC_KEYS = {
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_rate",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
}
SCHEDULER_LABELS = {"engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank"}
TOKENIZER_LABELS = {"engine_type", "is_streaming", "model_name"}
# family (as prometheus_client names it) -> (type, label names of its samples)
METRICS = {
    "sglang:num_running_reqs": ("gauge", SCHEDULER_LABELS),
    "sglang:num_queue_reqs": ("gauge", SCHEDULER_LABELS),
    "sglang:gen_throughput": ("gauge", SCHEDULER_LABELS),
    "sglang:spec_accept_length": ("gauge", SCHEDULER_LABELS),
    "sglang:realtime_tokens": ("counter", SCHEDULER_LABELS | {"mode"}),
    "sglang:generation_tokens": ("counter", TOKENIZER_LABELS),
    "sglang:prompt_tokens": ("counter", TOKENIZER_LABELS),
    "sglang:time_to_first_token_seconds": ("histogram", TOKENIZER_LABELS),
}


def metric_families(server: Server) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}


def sample(server: Server, name: str, **labels: str) -> float:
    """The value of the one sample `name` with `labels` (0 when it has none yet)."""
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


# -- endpoints --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", GET_ENDPOINTS)
def test_get_endpoints_answer_200(server: Server, path: str) -> None:
    assert server.get(path).status_code == 200, server.side


def test_generate_meta_info(server: Server) -> None:
    r = server.generate(8)
    assert r.status_code == 200
    body = r.json()
    assert {"text", "output_ids", "meta_info"} <= set(body)
    meta = body["meta_info"]
    assert set(meta) >= META_KEYS, sorted(META_KEYS - set(meta))
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == 8
    assert len(body["output_ids"]) == 8
    assert meta["num_retractions"] == 0
    # No speculative decoding: the spec keys are absent, not 0 (tokenizer_manager.py:3149).
    assert not SPEC_KEYS & set(meta), sorted(SPEC_KEYS & set(meta))
    assert "total_retractions" not in meta


def test_generate_stream_format(server: Server) -> None:
    """What the fleet's load generator reads from a stream (http_server.py:949-981): SSE
    `data: <json>` events, cumulative text, finish_reason only on the last, then [DONE]."""
    body = {
        "text": "Hello world",
        "sampling_params": {"max_new_tokens": 24, "temperature": 0},
        "stream": True,
    }
    r = server.post("/generate", body)
    assert r.status_code == 200, f"[{server.side}] {r.text[:300]}"
    assert r.headers["content-type"].startswith("text/event-stream"), server.side
    events = [e for e in r.text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), f"[{server.side}] {events[:3]}"
    assert events[-1] == "data: [DONE]", server.side
    docs = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert len(docs) >= 2, f"[{server.side}] one chunk per step, got {len(docs)}"
    *steps, last = docs
    assert all(d["meta_info"]["finish_reason"] is None for d in steps), server.side
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 24}, server.side
    assert set(last["meta_info"]) >= META_KEYS, server.side
    counts = [len(d["output_ids"]) for d in docs]
    assert counts == sorted(counts) and counts[-1] == 24, f"[{server.side}] {counts}"
    assert all(last["text"].startswith(d["text"]) for d in steps), server.side


def test_chat_smoke_test(server: Server) -> None:
    r = server.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Say hello in one word"}],
            "max_tokens": 10,
            "temperature": 0,
        },
    )
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 10
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 10


def test_generate_bad_request_body(server: Server) -> None:
    r = server.post("/generate", {"sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 400
    assert r.json() == {
        "error": {"message": "Either text, input_ids or input_embeds should be provided."}
    }


def test_chat_bad_request_body(server: Server) -> None:
    r = server.post("/v1/chat/completions", {"messages": []})
    assert r.status_code == 400
    body = r.json()
    assert set(body) == {"object", "message", "type", "param", "code"}
    assert (body["object"], body["code"], body["message"]) == (
        "error",
        400,
        "Messages cannot be empty.",
    )


def test_server_info_fields(server: Server) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = server.get(path).json()
        assert info["tp_size"] == 1
        assert info["speculative_algorithm"] is None
        assert info["disable_overlap_schedule"] is False
        assert info["model_path"].endswith("tiny-model")
        assert str(info["version"]).startswith("0.5.23")
        states = info["internal_states"]
        assert isinstance(states, list) and "last_gen_throughput" in states[0]


# -- metrics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(METRICS))
def test_metric_family_type_and_labels(server: Server, family: str) -> None:
    server.generate(2)  # every family has a sample once a request has finished
    families = metric_families(server)
    assert family in families, f"[{server.side}] no {family}"
    kind, labels = METRICS[family]
    assert families[family].type == kind
    for s in families[family].samples:
        assert set(s.labels) - {"le"} == labels, (s.name, sorted(s.labels))


def test_realtime_tokens_has_decode_and_prefill_modes(server: Server) -> None:
    server.generate(4)
    modes = {s.labels["mode"] for s in metric_families(server)["sglang:realtime_tokens"].samples}
    assert {"decode", "prefill_compute"} <= modes


def test_long_generation_moves_realtime_tokens_not_generation_tokens(server: Server) -> None:
    """The busy-vs-hung signal: only the scheduler's counter moves while nothing finishes."""
    decode = {"mode": "decode"}
    before_rt = sample(server, "sglang:realtime_tokens_total", **decode)
    before_gen = sample(server, "sglang:generation_tokens_total")
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(r=server.generate(1200, 120)))
    worker.start()
    try:
        deadline = time.monotonic() + 60
        # Both are scheduler series, published on SGLang's decode log interval (40 batches).
        while (
            sample(server, "sglang:realtime_tokens_total", **decode) <= before_rt
            or sample(server, "sglang:num_running_reqs") != 1
        ):
            assert time.monotonic() < deadline, "running request or decode tokens never shown"
            time.sleep(0.05)
        assert worker.is_alive(), "finished before it could be watched: make it longer"
        assert sample(server, "sglang:generation_tokens_total") == before_gen
    finally:
        worker.join(120)
    assert result["r"].json()["meta_info"]["completion_tokens"] == 1200
    assert sample(server, "sglang:generation_tokens_total") == before_gen + 1200


# -- processes --------------------------------------------------------------------------------


def test_process_titles_and_proc_views(server: Server) -> None:
    group = server.group()
    by_title = titled(group)
    assert set(by_title) == {"sglang::scheduler", "sglang::detokenizer"}  # tp 1: no _TP0
    for title, proc in by_title.items():
        cmdline = proc.cmdline()
        assert cmdline[0] == title and not any(cmdline[1:]), cmdline[:4]
        # The kernel's comm name is the title cut to 15 bytes.
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == title[:15]
        assert proc.ppid() == server.pid
        # setproctitle reused the environment's memory (no SPT_NOENV): it reads empty.
        assert proc.environ() == {}
    assert psutil.Process(server.pid).environ(), "the main process keeps its environment"


def test_resource_tracker_child(server: Server) -> None:
    trackers = [
        p
        for p in server.group()
        if "from multiprocessing.resource_tracker import main" in " ".join(p.cmdline())
    ]
    assert len(trackers) == 1
    assert trackers[0].ppid() == server.pid
    assert os.getpgid(trackers[0].pid) == server.pid


# -- logs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern",
    [
        r"server_args=",
        r"Load weight begin\.",
        r"Load weight end\.",
        r"KV Cache is allocated\.",
        r"max_total_num_tokens=\d+",
        r"INFO:     Uvicorn running on http://127\.0\.0\.1:\d+",
        r'"GET /model_info HTTP/1\.1" 200',
        r"The server is fired up and ready to roll!",
    ],
)
def test_start_up_log_lines(server: Server, pattern: str) -> None:
    server.wait_log(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] " + r".*" + pattern, timeout=1)


# -- serving quality (docs/quality.md) ---------------------------------------------------------


def test_generate_logprobs_as_the_canary_reads_them(server: Server) -> None:
    """return_logprob with top_logprobs_num 2: a [logprob, token_id, text] per output token and
    the top two per position (tokenizer_manager.py detokenize_logprob_tokens)."""
    from supervisor.quality import Answer, parse_answer

    body = {
        "text": "Hello world",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    r = server.post("/generate", body)
    assert r.status_code == 200, f"[{server.side}] {r.text[:300]}"
    got = parse_answer(r.content, elapsed_s=1.0)
    assert isinstance(got, Answer), f"[{server.side}] {got}"
    assert list(got.tokens) == r.json()["output_ids"], server.side
    assert all(m is not None and m >= 0 for m in got.margins), f"[{server.side}] {got.margins}"
    assert all(t is not None for t in got.top2), server.side


def test_decode_throughput_with_enable_metrics(server: Server) -> None:
    """--enable-metrics: meta_info.decode_throughput (observability/req_time_stats.py:500-532),
    what the quality watch reads as the single-stream decode speed."""
    meta = server.generate(8).json()["meta_info"]
    tput = meta.get("decode_throughput")
    assert isinstance(tput, float) and tput > 0, f"[{server.side}] {sorted(meta)}"


def test_decode_batch_lines_carry_the_graph_label(server: Server) -> None:
    """metrics_reporter.py:286-290,1040: every decode-batch line says `<device> graph: B`; the
    stand-in imitates a GPU's `cuda graph`, a real CPU server says `cpu graph`."""
    from supervisor.quality import decode_graph

    assert server.generate(96).status_code == 200
    line = server.wait_log(r"Decode batch[^\n]*graph: (True|False)[^\n]*", timeout=10).group(0)
    got = decode_graph(line)
    assert got is not None, f"[{server.side}] {line}"
    running, device, _used = got
    assert running >= 1
    assert device == ("cuda" if server.side == "standin" else "cpu"), line
