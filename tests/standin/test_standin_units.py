"""The stand-in's pure parts: flag parsing, settings, fault decisions, numbers, metrics text."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from supervisor.standin import faults as f
from supervisor.standin.args import parse_args, record_unknown
from supervisor.standin.engine import Engine, Outcome, completion_words, decide, spec_for
from supervisor.standin.faults import Settings, SettingsError, from_environ, next_launch
from supervisor.standin.logs import Log
from supervisor.standin.metrics import render

# -- flags ------------------------------------------------------------------------------------


def test_known_flags_and_aliases() -> None:
    args = parse_args(
        [
            "--model-path",
            "/m",
            "--tensor-parallel-size",
            "8",
            "--port",
            "31000",
            "--speculative-algorithm",
            "EAGLE3",
            "--disable-overlap-schedule",
        ]
    )
    assert (args.model_path, args.tp_size, args.port, args.host) == ("/m", 8, 31000, "127.0.0.1")
    assert args.speculative_algorithm == "EAGLE3"
    assert args.disable_overlap_schedule is True
    assert args.recorded == {}


def test_unknown_flags_are_recorded_in_snake_case() -> None:
    assert record_unknown(
        [
            "--cuda-graph-max-bs-decode",
            "128",
            "--enable-metrics",
            "--mem-fraction-static=0.85",
            "--cuda-graph-bs",
            "1",
            "2",
            "4",
            "--reasoning-parser",
            "kimi_k2",
            "--offset",
            "-1",
        ]
    ) == {
        "cuda_graph_max_bs_decode": 128,
        "enable_metrics": True,
        "mem_fraction_static": 0.85,
        "cuda_graph_bs": [1, 2, 4],
        "reasoning_parser": "kimi_k2",
        "offset": -1,
    }


def test_unknown_prefix_of_a_known_flag_is_not_taken_for_it() -> None:
    args = parse_args(["--model-path", "/m", "--tp", "4"])
    assert args.tp_size == 1
    assert args.recorded == {"tp": 4}


def test_bad_known_flag_exits_2_like_sglang() -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-path", "/m", "--tp-size", "eight"])
    assert exc.value.code == 2


def test_speculative_resolution() -> None:
    plain = parse_args(["--model-path", "/m"]).resolved()
    assert plain.speculative_algorithm is None
    assert plain.speculative_num_draft_tokens is None
    assert plain.served_model_name == "/m"
    spec = parse_args(["--model-path", "/m", "--speculative-algorithm", "EAGLE3"]).resolved()
    assert (
        spec.speculative_num_steps,
        spec.speculative_eagle_topk,
        spec.speculative_num_draft_tokens,
        spec.max_running_requests,
    ) == (3, 1, 4, 48)
    given = parse_args(
        [
            "--model-path",
            "/m",
            "--speculative-algorithm",
            "EAGLE3",
            "--max-running-requests",
            "64",
            "--speculative-num-draft-tokens",
            "2",
        ]
    )
    assert given.resolved().max_running_requests == 64
    assert given.resolved().speculative_num_draft_tokens == 2


def test_as_dict_is_flat_and_known_flags_win() -> None:
    args = parse_args(["--model-path", "/m", "--enable-metrics", "--tp-size", "2"])
    shown = args.resolved().as_dict()
    assert shown["enable_metrics"] is True
    assert shown["tp_size"] == 2
    assert "recorded" not in shown


# -- settings ---------------------------------------------------------------------------------


def test_defaults() -> None:
    s = from_environ({}, launch=1)
    assert s == Settings()
    assert (s.load_seconds, s.seconds_per_token, s.crash_sleep_seconds) == (2.0, 0.002, 65.0)
    assert (s.flood_lines, s.exit_code, s.hang_after_decodes) == (200_000, 1, 2)


def test_fault_list_is_parsed_and_checked() -> None:
    s = from_environ({"STANDIN_FAULT": "decode-hang, orphans"}, launch=1)
    assert s.faults == {f.DECODE_HANG, f.ORPHANS}
    with pytest.raises(SettingsError, match="decode-hnag"):
        from_environ({"STANDIN_FAULT": "decode-hnag"}, launch=1)


@pytest.mark.parametrize("name", f.FAULTS)
def test_every_documented_fault_name_is_accepted(name: str) -> None:
    assert from_environ({"STANDIN_FAULT": name}, launch=1).has(name)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "standin.md").read_text()
    assert f"`{name}`" in doc


def test_fault_only_on_the_kth_launch() -> None:
    env = {"STANDIN_FAULT": "crash-during-load", "STANDIN_FAULT_LAUNCH": "2"}
    assert from_environ(env, launch=1).faults == frozenset()
    assert from_environ(env, launch=2).faults == {f.CRASH_DURING_LOAD}
    assert from_environ(env, launch=3).faults == frozenset()


@pytest.mark.parametrize(
    "bad",
    [
        {"STANDIN_LOAD_SECONDS": "soon"},
        {"STANDIN_EXIT_CODE": "1.5"},
        {"STANDIN_FLOOD_LINES": "-3"},
    ],
)
def test_bad_numbers_are_named(bad: dict[str, str]) -> None:
    with pytest.raises(SettingsError, match=next(iter(bad))):
        from_environ(bad, launch=1)


def test_launch_counter(tmp_path: Path) -> None:
    path = tmp_path / "launches"
    assert next_launch(None) == 1
    assert [next_launch(str(path)) for _ in range(3)] == [1, 2, 3]
    assert path.read_text().strip() == "3"


def test_launch_counter_is_atomic_across_racing_launches(tmp_path: Path) -> None:
    path = str(tmp_path / "launches")
    got: list[int] = []
    lock = threading.Lock()

    def bump() -> None:
        for _ in range(20):
            n = next_launch(path)
            with lock:
                got.append(n)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 81))


# -- decisions and numbers --------------------------------------------------------------------


def _with(*names: str, hang_after_decodes: int = 1) -> Settings:
    return Settings(faults=frozenset(names), hang_after_decodes=hang_after_decodes)


def test_decide() -> None:
    assert decide(Settings(), 0, 8) is Outcome.NORMAL
    assert decide(_with(f.SEED_INCIDENT), 0, 8) is Outcome.CRASH
    assert decide(_with(f.SEED_INCIDENT), 0, 1) is Outcome.NORMAL  # the 1-token health shape
    assert decide(_with(f.DECODE_500), 0, 8) is Outcome.ERROR
    assert decide(_with(f.DECODE_ZERO_TOKENS), 0, 8) is Outcome.ZERO
    assert decide(_with(f.SLOW_DECODE), 0, 8) is Outcome.SLOW
    assert decide(_with(f.DECODE_HANG), 0, 8) is Outcome.NORMAL
    assert decide(_with(f.DECODE_HANG), 1, 8) is Outcome.HANG
    assert decide(_with(f.DECODE_HANG, hang_after_decodes=3), 2, 8) is Outcome.NORMAL
    assert decide(_with(f.DECODE_HANG, hang_after_decodes=0), 0, 8) is Outcome.HANG
    # STANDIN_HANG_MIN_TOKENS=16: the 16-token canary hangs, the 8-token probe answers.
    long_only = Settings(
        faults=frozenset({f.DECODE_HANG}), hang_after_decodes=0, hang_min_tokens=16
    )
    assert decide(long_only, 5, 8) is Outcome.NORMAL
    assert decide(long_only, 5, 16) is Outcome.HANG
    assert from_environ({"STANDIN_HANG_MIN_TOKENS": "16"}, 1).hang_min_tokens == 16


def test_spec_numbers_follow_sglangs_formula() -> None:
    spec = spec_for(8, num_draft_tokens=4)
    assert spec.verify_ct == 3
    assert spec.accept_length == pytest.approx(8 / 3)
    assert spec.draft_tokens == 3 * 3
    assert spec.accepted_tokens == 8 - 3
    assert spec_for(0, 4).verify_ct == 0


def test_completion_is_deterministic() -> None:
    assert completion_words("Say hello", 5) == ["Say", "hello", "Say", "hello", "Say"]
    assert completion_words("", 2) == ["hello", "hello"]


def test_metrics_text_names_and_labels() -> None:
    args = parse_args(["--model-path", "/m", "--served-model-name", "kimi"]).resolved()
    engine = Engine(args, Settings(), Log(fd=-1), on_fatal=lambda: None)
    engine._count(7)
    engine._observe_ttft(0.03)
    text = render(engine)
    sched = 'engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    tok = 'engine_type="unified",is_streaming="false",model_name="kimi"'
    assert f"sglang:num_running_reqs{{{sched}}} 0.0" in text
    assert f'sglang:realtime_tokens_total{{{sched},mode="decode"}} 7.0' in text
    assert "# TYPE sglang:realtime_tokens_total counter" in text
    # Nothing finished yet: the tokenizer manager's counter has not moved.
    assert f"sglang:generation_tokens_total{{{tok}}} 0.0" in text
    assert "# TYPE sglang:generation_tokens_total counter" in text
    assert f'sglang:time_to_first_token_seconds_bucket{{{tok},le="0.02"}} 0.0' in text
    assert f'sglang:time_to_first_token_seconds_bucket{{{tok},le="0.04"}} 1.0' in text
    assert f'sglang:time_to_first_token_seconds_bucket{{{tok},le="+Inf"}} 1.0' in text
    assert text.endswith("\n")
