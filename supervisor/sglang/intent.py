"""Does the running server do what the config asked for? Pure: no I/O.

SGLang resolves its arguments at start-up and may quietly override what it was given: an older
release without `SGLANG_ENABLE_SPEC_V2=1` turned the overlap scheduler off for EAGLE, and a
draft model it cannot use can leave speculative decoding off while the server serves happily,
only slower. The seed incident was confirmed by grepping a log line that SGLang 0.5.23 no longer
prints. So after the first successful probe the daemon reads `/server_info` (the resolved
arguments; SGLang's `build_server_info()` starts from `ServerArgs.resolved_dict()`, older releases
from `dataclasses.asdict(server_args)`, with the same field names) and the probe's
`meta_info.spec_verify_ct`, and compares them with the intent computed here.

A field the server does not report is unknown, never a mismatch: older releases lack some, and a
stand-in reports only a few.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.sglang.argv import LaunchSpec

# The probe's evidence that draft + verify really ran (docs/sglang.md, "Decode probe").
SPEC_VERIFY_CT = "spec_verify_ct"

# Config flag (with its aliases) -> /server_info field, for the integer speculative settings
# compared only when the config sets them (otherwise SGLang picks them, and any value is right).
_SPEC_INT_FIELDS = {
    "speculative_num_steps": ("speculative-num-steps",),
    "speculative_eagle_topk": ("speculative-eagle-topk",),
    "speculative_num_draft_tokens": ("speculative-num-draft-tokens",),
}

# Names SGLang rewrites while resolving, so the server reports another name for the same intent.
# speculative_hook.py: NEXTN is an alias of EAGLE, and a Gemma4 assistant draft turns EAGLE/NEXTN
# into FROZEN_KV_MTP. serving_hook.py: deprecated attention-backend spellings.
_ALGORITHM_EQUIVALENTS = {
    "NEXTN": frozenset({"NEXTN", "EAGLE", "FROZEN_KV_MTP"}),
    "EAGLE": frozenset({"EAGLE", "FROZEN_KV_MTP"}),
}
_BACKEND_ALIASES = {"compressed": "dsv4", "tokenspeed_mla": "cutedsl_mla"}

# Values meaning "no speculative decoding" in config and in /server_info.
_OFF = (None, "", "NONE")


@dataclass(frozen=True)
class Mismatch:
    """One resolved server argument (or probe fact) that differs from the intent."""

    arg: str
    expected: object
    actual: object

    @property
    def message(self) -> str:
        return f"{self.arg}: configured {_show(self.expected)}, server runs {_show(self.actual)}"


def _show(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _algorithm(value: object) -> str | None:
    if value is None or value is False:
        return None
    text = str(value).strip().upper()
    return None if text in _OFF else text


def expected_server_args(spec: LaunchSpec) -> dict[str, object]:
    """The `/server_info` fields, with the values this launch should produce.

    Only fields whose value follows from the config: tp size, the speculative algorithm (or none),
    the speculative counts and the attention backend where the config sets them, and the overlap
    scheduler (on unless the config turns it off).
    """
    args = spec.args
    expected: dict[str, object] = {"tp_size": spec.tp_size}
    algorithm = _algorithm(args.get("speculative-algorithm"))
    expected["speculative_algorithm"] = algorithm
    if algorithm is not None:
        for field, names in _SPEC_INT_FIELDS.items():
            for name in names:
                number = _as_int(args.get(name))
                if number is not None:
                    expected[field] = number
                    break
    backend = args.get("attention-backend")
    if isinstance(backend, str) and backend:
        expected["attention_backend"] = _BACKEND_ALIASES.get(backend, backend)
    expected["disable_overlap_schedule"] = args.get("disable-overlap-schedule") is True
    return expected


def _same(field: str, expected: object, actual: object) -> bool:
    if field == "speculative_algorithm":
        want, got = _algorithm(expected), _algorithm(actual)
        if want is None or got is None:
            return want == got
        return got in _ALGORITHM_EQUIVALENTS.get(want, frozenset({want}))
    if field == "attention_backend":
        return isinstance(actual, str) and _BACKEND_ALIASES.get(actual, actual) == expected
    if isinstance(expected, bool):
        return isinstance(actual, bool) and actual == expected
    if isinstance(expected, int):
        return _as_int(actual) == expected
    return actual == expected


def compare(
    spec: LaunchSpec,
    server_info: Mapping[str, Any],
    probe_meta: Mapping[str, Any] | None,
) -> list[Mismatch]:
    """Every intended setting the server reports differently. Absent fields are skipped, and
    so are the speculative counts when the server runs no speculative algorithm at all (that
    one mismatch says it; its empty counts would only repeat it)."""
    spec_off = "speculative_algorithm" in server_info and (
        _algorithm(server_info["speculative_algorithm"]) is None
    )
    mismatches = [
        Mismatch(field, want, server_info[field])
        for field, want in expected_server_args(spec).items()
        if field in server_info
        and not (spec_off and field in _SPEC_INT_FIELDS)
        and not _same(field, want, server_info[field])
    ]
    if spec.speculative and probe_meta is not None and SPEC_VERIFY_CT in probe_meta:
        count = _as_int(probe_meta[SPEC_VERIFY_CT])
        if count is None or count <= 0:
            # The server answered, but no token went through draft + verify: EAGLE is off.
            mismatches.append(Mismatch(SPEC_VERIFY_CT, "> 0", probe_meta[SPEC_VERIFY_CT]))
    return mismatches


def unknown_fields(spec: LaunchSpec, server_info: Mapping[str, Any]) -> list[str]:
    """Intended fields the server does not report (an older SGLang, or a stand-in)."""
    return [field for field in expected_server_args(spec) if field not in server_info]
