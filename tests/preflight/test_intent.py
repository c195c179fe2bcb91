"""After ready: does the running server do what the config asked for?

`/server_info` in SGLang 0.5.23 is `ServerArgs.resolved_dict()` plus `launch_command`, the
scheduler info, `internal_states`, `version` (utils/common.py build_server_info,
entrypoints/http_server.py server_info); older releases serve `dataclasses.asdict(server_args)`
with the same field names. The dicts below have that shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.config import load
from supervisor.sglang.argv import LaunchSpec, build
from supervisor.sglang.intent import Mismatch, compare, expected_server_args, unknown_fields
from testkit import free_port
from testkit.paths import REPO_ROOT
from testkit.preflight import MakeConfig
from testkit.standin import Standin


@pytest.fixture(scope="module")
def production() -> dict[str, LaunchSpec]:
    cfg = load(str(REPO_ROOT / "etc" / "kimi-serve.yaml"))
    return {p: build(cfg, p) for p in cfg.profile_names}


def server_info(**overrides: Any) -> dict[str, Any]:
    """What SGLang 0.5.23 answers for the production command line, EAGLE-3 and overlap on."""
    info: dict[str, Any] = {
        "model_path": "/shared/kimi-k2.5-int4",
        "tokenizer_path": "/shared/kimi-k2.5-int4",
        "tp_size": 8,
        "pp_size": 1,
        "dp_size": 1,
        "attention_backend": "flashinfer",
        "decode_attention_backend": "flashinfer",
        "disable_overlap_schedule": False,
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": "/shared/kimi-k2.5-eagle3",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        "cuda_graph_max_bs_decode": 128,
        "max_running_requests": 48,
        "enable_dp_attention": False,
        "launch_command": "python -m sglang.launch_server --model-path ...",
        "max_total_num_tokens": 1_200_000,
        "internal_states": [{"avg_spec_accept_length": 2.9, "last_gen_throughput": 812.0}],
        "version": "0.5.23",
        "frontend": "python",
    }
    info.update(overrides)
    return info


GOOD_META = {"completion_tokens": 8, "spec_verify_ct": 3, "spec_accept_length": 2.7}


def test_expected_args_for_production(production: dict[str, LaunchSpec]) -> None:
    assert expected_server_args(production["primary"]) == {
        "tp_size": 8,
        "speculative_algorithm": "EAGLE3",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        "attention_backend": "flashinfer",
        "disable_overlap_schedule": False,
    }
    assert expected_server_args(production["fallback"]) == {
        "tp_size": 8,
        "speculative_algorithm": None,
        "attention_backend": "flashinfer",
        "disable_overlap_schedule": False,
    }


def test_a_server_doing_what_was_asked_has_no_mismatch(
    production: dict[str, LaunchSpec],
) -> None:
    assert compare(production["primary"], server_info(), GOOD_META) == []
    fallback = server_info(speculative_algorithm=None, speculative_num_steps=None)
    assert compare(production["fallback"], fallback, {"spec_verify_ct": 0}) == []


def test_eagle_quietly_off_is_reported(production: dict[str, LaunchSpec]) -> None:
    info = server_info(speculative_algorithm=None)
    meta = {"completion_tokens": 8, "spec_verify_ct": 0}
    assert compare(production["primary"], info, meta) == [
        Mismatch("speculative_algorithm", "EAGLE3", None),
        Mismatch("spec_verify_ct", "> 0", 0),
    ]


def test_overlap_scheduler_off_is_reported(production: dict[str, LaunchSpec]) -> None:
    # What an older SGLang did for EAGLE without SGLANG_ENABLE_SPEC_V2=1.
    found = compare(production["primary"], server_info(disable_overlap_schedule=True), GOOD_META)
    assert found == [Mismatch("disable_overlap_schedule", False, True)]
    assert found[0].message == "disable_overlap_schedule: configured false, server runs true"


def test_resolved_values_that_differ_are_reported(production: dict[str, LaunchSpec]) -> None:
    info = server_info(
        tp_size=4,
        speculative_eagle_topk=4,
        speculative_num_draft_tokens=8,
        attention_backend="triton",
    )
    assert [m.arg for m in compare(production["primary"], info, GOOD_META)] == [
        "tp_size",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
        "attention_backend",
    ]


def test_fields_an_older_sglang_lacks_are_unknown_not_mismatched(
    production: dict[str, LaunchSpec],
) -> None:
    old = {"tp_size": 8, "speculative_algorithm": "EAGLE3", "version": "0.4.6"}
    assert compare(production["primary"], old, {"completion_tokens": 8}) == []
    assert unknown_fields(production["primary"], old) == [
        "speculative_num_steps",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
        "attention_backend",
        "disable_overlap_schedule",
    ]
    assert compare(production["primary"], {}, None) == []


def test_sglang_spellings_of_the_same_intent_match(make_config: MakeConfig) -> None:
    spec = build(
        make_config(
            args={
                "speculative-algorithm": "nextn",
                "attention-backend": "compressed",
                "tp-size": "2",
            }
        )
    )
    info = {"speculative_algorithm": "EAGLE", "attention_backend": "dsv4", "tp_size": 2}
    assert compare(spec, info, {"spec_verify_ct": 5}) == []
    assert compare(spec, {**info, "speculative_algorithm": "NONE"}, None) == [
        Mismatch("speculative_algorithm", "NEXTN", "NONE"),
    ]


def test_an_empty_verify_count_is_reported(production: dict[str, LaunchSpec]) -> None:
    found = compare(production["primary"], server_info(), {"spec_verify_ct": 0})
    assert found == [Mismatch("spec_verify_ct", "> 0", 0)]
    assert compare(production["primary"], server_info(), {"completion_tokens": 8}) == []


def test_speculative_on_when_not_asked_is_reported(production: dict[str, LaunchSpec]) -> None:
    found = compare(production["fallback"], server_info(), {"spec_verify_ct": 4})
    assert found == [Mismatch("speculative_algorithm", None, "EAGLE3")]


def test_overlap_off_by_config_is_expected(make_config: MakeConfig) -> None:
    spec = build(make_config(args={"disable-overlap-schedule": True}))
    assert compare(spec, {"disable_overlap_schedule": True, "tp_size": 1}, None) == []


@pytest.fixture
def standins() -> Iterator[list[Standin]]:
    started: list[Standin] = []
    yield started
    for standin in started:
        standin.cleanup()


def run_standin(spec: LaunchSpec, started: list[Standin], port: int) -> dict[str, Any]:
    """Launch the stand-in with spec's flags; return its /server_info and a probe's meta."""
    standin = Standin(list(spec.argv[3:]), {}, port)
    started.append(standin)
    standin.wait_ready()
    base = f"http://127.0.0.1:{port}"
    info = httpx.get(f"{base}/server_info", timeout=10).json()
    probe = httpx.post(
        f"{base}/generate",
        json={"text": "Say hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        timeout=10,
    ).json()
    return {"info": info, "meta": probe["meta_info"]}


def test_the_standin_matches_its_own_launch(
    make_config: MakeConfig, standins: list[Standin], tmp_path: Path
) -> None:
    port = free_port()
    cfg = make_config(
        port=port,
        args={
            "speculative-algorithm": "EAGLE3",
            "speculative-num-steps": 3,
            "speculative-eagle-topk": 1,
            "speculative-num-draft-tokens": 4,
            "attention-backend": "flashinfer",
        },
        profiles={"fallback": {"args": {"speculative-algorithm": None}}},
    )
    got = run_standin(build(cfg), standins, port)
    assert got["meta"]["spec_verify_ct"] > 0
    assert compare(build(cfg), got["info"], got["meta"]) == []


def test_the_standin_shows_a_mismatch_when_eagle_is_off(
    make_config: MakeConfig, standins: list[Standin]
) -> None:
    port = free_port()
    cfg = make_config(
        port=port,
        args={"speculative-algorithm": "EAGLE3", "speculative-eagle-topk": 1},
        profiles={
            "quiet": {
                "args": {
                    "speculative-algorithm": None,
                    "speculative-eagle-topk": None,
                    "disable-overlap-schedule": True,
                }
            }
        },
    )
    # The server really runs the "quiet" command line; the intent is primary's.
    got = run_standin(build(cfg, "quiet"), standins, port)
    found = {m.arg: m for m in compare(build(cfg), got["info"], got["meta"])}
    assert set(found) == {"speculative_algorithm", "disable_overlap_schedule"}
    assert found["speculative_algorithm"].actual is None
    # Like SGLang, a server without speculative decoding leaves spec_verify_ct out of its
    # meta_info: unknown, so not a second mismatch.
    assert "spec_verify_ct" not in got["meta"]
