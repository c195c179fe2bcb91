"""Every endpoint and schema, against two stand-ins started once per module."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest

from testkit.standin import MODEL, Launcher, Standin

SPEC_FLAGS = (
    "--tp-size",
    "2",
    "--speculative-algorithm",
    "EAGLE3",
    "--speculative-draft-model-path",
    "/models/kimi-eagle3",
    "--served-model-name",
    "kimi",
    "--enable-metrics",
    "--cuda-graph-max-bs-decode",
    "128",
    "--mem-fraction-static",
    "0.85",
)


@pytest.fixture(scope="module")
def spec(module_launch: Launcher) -> Standin:
    return module_launch(*SPEC_FLAGS)


@pytest.fixture(scope="module")
def plain(module_launch: Launcher) -> Standin:
    return module_launch("--reasoning-parser", "kimi_k2")


# -- processes and logs -----------------------------------------------------------------------


def test_children_are_real_processes_with_sglang_titles(spec: Standin) -> None:
    children = spec.children()
    # setproctitle: the title replaces argv (sglang/srt/managers/scheduler.py:6294).
    assert sorted(c.cmdline()[0] for c in children) == [
        "sglang::detokenizer",
        "sglang::scheduler_TP0",
        "sglang::scheduler_TP1",
    ]
    for child in children:
        assert child.ppid() == spec.proc.pid
        assert os.getpgid(child.pid) == spec.proc.pid  # in the group the supervisor kills
        assert child.name().startswith("sglang::")


def test_loading_log_and_speculative_warnings(spec: Standin) -> None:
    spec.wait_line("Load weight begin")
    spec.wait_line("Capture cuda graph end")
    spec.wait_line("Max running requests is reset to 48 for speculative decoding")
    assert spec.count("Non-overlap (synchronous) spec v2") == 0  # 0.5.23: silent with overlap
    bound = spec.lines.index(next(line for line in spec.lines if "Uvicorn running on" in line))
    loaded = spec.lines.index(next(line for line in spec.lines if "Load weight end" in line))
    assert loaded < bound, "the port is bound only after loading"


def test_every_line_is_sglang_shaped(spec: Standin) -> None:
    spec.get("/health")
    spec.wait_line('"GET /health HTTP/1.1" 200 OK')
    shape = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d( TP\d+)?\] ")
    assert [line for line in spec.lines if not shape.match(line)] == []


# -- health and info --------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/health", "/health_generate", "/ready"])
def test_health_and_ready(spec: Standin, path: str) -> None:
    r = spec.get(path)
    assert (r.status_code, r.content) == (200, b"")


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info(spec: Standin, path: str) -> None:
    info = spec.get(path).json()
    assert info["model_path"] == MODEL
    assert info["served_model_name"] == "kimi"
    assert info["tp_size"] == 2
    assert info["speculative_algorithm"] == "EAGLE3"
    assert info["speculative_draft_model_path"] == "/models/kimi-eagle3"
    assert (
        info["speculative_num_steps"],
        info["speculative_eagle_topk"],
        info["speculative_num_draft_tokens"],
    ) == (3, 1, 4)
    assert info["disable_overlap_schedule"] is False
    assert info["attention_backend"] is None
    assert info["max_running_requests"] == 48
    # Flags the stand-in does not act on are recorded under their snake_case names.
    assert info["enable_metrics"] is True
    assert info["cuda_graph_max_bs_decode"] == 128
    assert info["mem_fraction_static"] == 0.85
    assert info["version"] == "0.5.23-standin"
    (state,) = info["internal_states"]
    assert set(state) >= {"avg_spec_accept_length", "last_gen_throughput"}
    assert state["avg_spec_accept_length"] > 1.0  # the warmup decode already ran speculatively


def test_server_info_without_speculation(plain: Standin) -> None:
    info = plain.get("/server_info").json()
    assert info["speculative_algorithm"] is None
    assert info["speculative_num_draft_tokens"] is None
    assert info["served_model_name"] == MODEL
    assert info["tp_size"] == 1
    assert info["reasoning_parser"] == "kimi_k2"
    assert info["internal_states"][0]["avg_spec_accept_length"] is None


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info(spec: Standin, path: str) -> None:
    info = spec.get(path).json()
    assert info["model_path"] == MODEL
    assert info["is_generation"] is True


def test_v1_models(spec: Standin) -> None:
    (card,) = spec.get("/v1/models").json()["data"]
    assert card["id"] == "kimi"


# -- decoding ---------------------------------------------------------------------------------


def test_generate_schema_with_speculative_decoding(spec: Standin) -> None:
    r = spec.generate(max_new_tokens=16)
    assert r.status_code == 200
    body = r.json()
    meta = body["meta_info"]
    assert meta["completion_tokens"] == 16
    assert meta["finish_reason"] == {"type": "length", "length": 16}
    assert meta["prompt_tokens"] == 5
    assert meta["cached_tokens"] == 0
    assert meta["e2e_latency"] > 0
    assert isinstance(meta["id"], str)
    assert meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] == pytest.approx(16 / meta["spec_verify_ct"])
    assert len(body["output_ids"]) == 16
    assert body["text"].split() == ["Say", "hello", "in", "one", "word"] * 3 + ["Say"]


def test_generate_stream_is_sglangs_server_sent_events(spec: Standin) -> None:
    body = {"text": "Say hello", "sampling_params": {"max_new_tokens": 64}, "stream": True}
    with httpx.Client(trust_env=False, timeout=10) as c:
        r = c.post(spec.url("/generate"), json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events[:3]
    assert events[-1] == "data: [DONE]"
    docs = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert len(docs) >= 2, "one chunk per decode step, not one answer"
    *steps, last = docs
    # Not incremental: each chunk holds everything so far; finish_reason only on the last.
    assert all(d["meta_info"]["finish_reason"] is None for d in steps)
    counts = [len(d["output_ids"]) for d in docs]
    assert counts == sorted(counts) and counts[-1] == 64
    assert all(last["text"].startswith(d["text"]) for d in steps)
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 64}
    plain = spec.post("/generate", {**body, "stream": False}).json()
    assert last["text"] == plain["text"]


def test_generate_from_input_ids(spec: Standin) -> None:
    r = spec.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200
    assert r.json()["meta_info"]["completion_tokens"] == 4
    assert r.json()["meta_info"]["prompt_tokens"] == 3


def test_generate_without_speculation_has_no_spec_fields(plain: Standin) -> None:
    meta = plain.generate(max_new_tokens=8).json()["meta_info"]
    assert meta["completion_tokens"] == 8
    assert not [k for k in meta if k.startswith("spec_")]


def test_chat_completion_schema(spec: Standin) -> None:
    body = spec.chat(max_tokens=10).json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "/shared/kimi-k2.5-int4"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 10
    assert choice["message"]["reasoning_content"] is None
    usage = body["usage"]
    assert usage["completion_tokens"] == 10
    assert usage["total_tokens"] == usage["prompt_tokens"] + 10


def test_chat_with_reasoning_parser_answers_in_reasoning_content(plain: Standin) -> None:
    body = plain.chat(max_tokens=10).json()
    message = body["choices"][0]["message"]
    assert message["content"] is None
    assert len(message["reasoning_content"].split()) == 10
    assert body["usage"]["completion_tokens"] == 10
    assert body["usage"]["reasoning_tokens"] == 10


@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", {"sampling_params": {"max_new_tokens": 4}}),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "many"}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("/v1/chat/completions", {"messages": []}),
    ],
)
def test_bad_requests_answer_400(spec: Standin, path: str, body: object) -> None:
    r = spec.post(path, body)
    assert r.status_code == 400
    # SGLang: {"error": {"message"}} from /generate, the OpenAI error object from /v1/.
    error = r.json()
    message = error["message"] if path.startswith("/v1/") else error["error"]["message"]
    assert message


# -- metrics ----------------------------------------------------------------------------------


def test_metrics_series_and_counters(spec: Standin) -> None:
    text = spec.get("/metrics").text
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:gen_throughput",
        "sglang:generation_tokens_total",
        "sglang:prompt_tokens_total",
        "sglang:spec_accept_length",
        "sglang:time_to_first_token_seconds_bucket",
    ):
        assert re.search(rf'^{name}{{[^}}]*model_name="kimi"', text, re.M), name
    assert 'tp_rank="0"' in text
    tokens, prompts = (
        spec.metric("sglang:generation_tokens_total"),
        spec.metric("sglang:prompt_tokens_total"),
    )
    ttft = spec.metric("sglang:time_to_first_token_seconds_count")
    assert spec.generate(max_new_tokens=12).status_code == 200
    assert spec.metric("sglang:generation_tokens_total") == tokens + 12
    assert spec.metric("sglang:prompt_tokens_total") == prompts + 5
    assert spec.metric("sglang:time_to_first_token_seconds_count") == ttft + 1
    assert spec.metric("sglang:num_running_reqs") == 0
    assert spec.metric("sglang:spec_accept_length") > 1.0
    assert spec.metric("sglang:gen_throughput") > 0


@pytest.mark.parametrize("how", ["flag", "config"])
def test_a_keyed_stand_in_answers_only_requests_that_carry_the_key(
    launch: Launcher, tmp_path: Path, how: str
) -> None:
    # SGLang 0.5.23 (srt/utils/auth.py, decide_request_auth): with --api-key, or api-key in
    # the YAML of --config (what kimi-serve passes), every path but /health*, /ready* and
    # /metrics needs `Authorization: Bearer <key>`; 401 {"error": "Unauthorized"} otherwise.
    key = "sk-standin-key"
    if how == "flag":
        s = launch("--api-key", key)
    else:
        secrets_file = tmp_path / "secrets.yaml"
        secrets_file.write_text(f"api-key: {key}\n")
        s = launch("--config", str(secrets_file))
    url = s.url("")
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    refused = httpx.post(url + "/generate", json=body, timeout=30)
    assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
    assert httpx.get(url + "/server_info", timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer sk-other"}
    assert httpx.get(url + "/server_info", headers=wrong, timeout=30).status_code == 401
    for open_path in ("/health", "/health_generate", "/ready", "/metrics"):
        assert httpx.get(url + open_path, timeout=30).status_code == 200, open_path
    keyed = {"Authorization": f"bearer {key}"}  # the scheme in any case
    assert httpx.post(url + "/generate", json=body, headers=keyed, timeout=30).status_code == 200
