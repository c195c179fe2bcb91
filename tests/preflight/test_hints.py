"""The table of known renames, the hints built from SGLang's errors, and the verdict helpers.

Pure functions: no SGLang needed. The error strings are the ones SGLang 0.5.23's parser gives.
"""

from __future__ import annotations

import pytest

from supervisor.preflight import EX_CONFIG, Check, exit_code, failures, summary
from supervisor.sglang.options import (
    KNOWN_FLAGS,
    abbreviations,
    error_flags,
    flag_values,
    known_changes,
    rejection_hint,
)

AMBIGUOUS = (
    "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, "
    "--cuda-graph-max-bs-prefill"
)
INVALID_CHOICE = (
    "argument --reasoning-parser: invalid choice: 'kimi-k2' (choose from 'auto', 'deepseek-r1', "
    "'kimi', 'kimi_k2', 'kimi_k3', 'qwen3')"
)
OPTIONS = [
    "--enable-metrics",
    "--enable-mis",
    "--tp-size",
    "--disable-overlap-schedule",
    "--cuda-graph-max-bs-decode",
    "--cuda-graph-max-bs-prefill",
    "--model-path",
]


def test_flag_values_reads_both_spellings_and_bare_flags() -> None:
    argv = ["--tp-size", "8", "--enable-metrics", "--x=1", "--nargs", "a", "b", "--last"]
    assert flag_values(argv) == [
        ("tp-size", "8"),
        ("enable-metrics", None),
        ("x", "1"),
        ("nargs", "a"),
        ("last", None),
    ]


def test_known_changes_finds_flags_and_values_once() -> None:
    argv = [
        "--cuda-graph-max-bs",
        "128",
        "--tool-call-parser",
        "qwen25",
        "--cuda-graph-max-bs=64",
        "--attention-backend",
        "flashinfer",
    ]
    found = known_changes(argv)
    assert [c.what for c in found] == ["--cuda-graph-max-bs", "--tool-call-parser qwen25"]
    assert found[0].rejected and not found[1].rejected


def test_the_incident_flag_hint_names_both_replacements() -> None:
    hint = rejection_hint(AMBIGUOUS, OPTIONS)
    assert "cuda-graph-max-bs-decode: N" in hint and "cuda-graph-max-bs-prefill" in hint


def test_an_ambiguous_flag_not_in_the_table_gets_sglangs_candidates() -> None:
    error = (
        "ambiguous option: --speculative-draft could match --speculative-draft-model-path, "
        "--speculative-draft-model-revision"
    )
    hint = rejection_hint(error, OPTIONS)
    assert "write the full name" in hint and "--speculative-draft-model-path" in hint


def test_unrecognized_flags_get_table_hints_or_a_guess() -> None:
    error = "unrecognized arguments: --enable-metrix --enable-ep-moe --frobnicate 3"
    hint = rejection_hint(error, OPTIONS).splitlines()
    assert (
        hint[0] == "--enable-metrix: not a flag of this SGLang; did you mean "
        "--enable-metrics or --enable-mis?"
    )
    assert hint[1] == "--enable-ep-moe: removed: write ep-size: N with the same N as tp-size"
    assert hint[2].startswith("--frobnicate: not a flag of this SGLang; it was removed")


def test_an_invalid_choice_gets_the_closest_choice() -> None:
    hint = rejection_hint(INVALID_CHOICE, OPTIONS)
    assert (
        hint == "--reasoning-parser 'kimi-k2' is not a choice of this SGLang; "
        "did you mean 'kimi_k2'?"
    )


def test_an_invalid_choice_that_was_renamed_gets_the_table_hint() -> None:
    error = "argument --lora-backend: invalid choice: 'flashinfer' (choose from 'triton', 'csgmv')"
    assert rejection_hint(error) == "--lora-backend flashinfer: removed: write lora-backend: triton"


def test_a_wrong_type_says_which() -> None:
    error = "argument --tp-size/--tensor-parallel-size: invalid int value: 'eight'"
    assert rejection_hint(error) == "--tp-size needs a value of type int, not 'eight'"


@pytest.mark.parametrize(
    ("error", "flags"),
    [
        (AMBIGUOUS, ["--cuda-graph-max-bs"]),
        ("unrecognized arguments: --a 1 --b=2", ["--a", "--b"]),
        (
            "argument --tp-size/--tensor-parallel-size: invalid int value: 'x'",
            ["--tp-size", "--tensor-parallel-size"],
        ),
        ("the following arguments are required: --model-path", []),
    ],
)
def test_error_flags(error: str, flags: list[str]) -> None:
    assert error_flags(error) == flags


def test_abbreviations_are_found_exact_names_are_not() -> None:
    argv = ["--disable-overlap", "--tp-size", "8", "--model-path", "/m", "--nope"]
    assert abbreviations(argv, OPTIONS) == [("--disable-overlap", "--disable-overlap-schedule")]


def test_every_table_entry_has_a_hint_that_says_what_to_write() -> None:
    for name, change in KNOWN_FLAGS.items():
        assert change.what == f"--{name}"
        assert "write" in change.hint, name


def check(name: str, ok: bool, kind: str = "config", **kw: object) -> Check:
    return Check(name, ok, kind, f"{name} says so", **kw)  # type: ignore[arg-type]


def test_exit_codes() -> None:
    assert exit_code([check("a", True), check("b", True, warning=True)]) == 0
    assert exit_code([check("a", False, "host")]) == 1
    assert exit_code([check("a", False, "host"), check("b", False, "config")]) == EX_CONFIG


def test_summary_puts_config_problems_first_and_fits_one_line() -> None:
    checks = [
        check("port", False, "host"),
        check("parser[primary]", False, "config", hint="do this\nthen that"),
        check("interpreter", True),
    ]
    line = summary(checks)
    assert line.startswith(
        "preflight config problem (+1 more): parser[primary]: parser[primary] says so"
    )
    assert line.endswith("| hint: do this then that")
    assert "\n" not in line
    assert len(summary([check("x" * 1000, False)], limit=100)) == 100
    assert (
        summary([check("a", True), check("b", True, warning=True)])
        == "preflight ok (2 checks, 1 warning(s): b)"
    )
    assert [c.name for c in failures(checks, "host")] == ["port"]


def test_render_shows_status_and_indented_hint() -> None:
    text = check("gpus", False, "host", hint="one\ntwo").render()
    lines = text.splitlines()
    assert lines[0].startswith("FAIL  gpus")
    assert lines[1].strip() == "one" and lines[2].strip() == "two"
    assert check("x", True, skipped=True).status == "skip"
    assert check("x", True, warning=True).as_dict()["status"] == "WARN"
