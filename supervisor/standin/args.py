"""SGLang's command line, as far as the stand-in needs it.

The flags it acts on are parsed like SGLang's `ServerArgs.add_cli_args`
(python/sglang/srt/server_args.py); every other flag is accepted and recorded, so a
supervisor's full production command line runs unchanged against the stand-in and shows up
in /server_info under its snake_case name, as SGLang's `dataclasses.asdict(server_args)` does.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

# Recorded values are coerced like argparse `type=int` / `type=float` would; anything else
# (paths, JSON blobs, names) stays a string. A flag followed by several values (nargs="+")
# becomes a list, a bare flag becomes True.
Scalar = bool | int | float | str
Recorded = Scalar | list[Scalar]

# SGLang's auto-chosen EAGLE parameters when only the algorithm is given
# (server_args.py, auto_choose_speculative_params): 3 steps, top-k 1, 4 draft tokens.
_AUTO_SPEC_STEPS = 3
_AUTO_SPEC_TOPK = 1
_AUTO_SPEC_DRAFT_TOKENS = 4
# With speculative decoding and no --max-running-requests SGLang caps it at 48
# (server_args.py, _handle_speculative_decoding).
SPEC_MAX_RUNNING_REQUESTS = 48
DEFAULT_MAX_RUNNING_REQUESTS = 1024


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    served_model_name: str | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    attention_backend: str | None = None
    disable_overlap_schedule: bool = False
    max_running_requests: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    recorded: dict[str, Recorded] = dataclasses.field(default_factory=dict)

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def model_name(self) -> str:
        """The name SGLang reports (`served_model_name` defaults to the model path)."""
        return self.served_model_name or self.model_path

    def resolved(self) -> ServerArgs:
        """Fill what SGLang fills after parsing, so /server_info shows the effective values."""
        steps, topk, draft = (
            self.speculative_num_steps,
            self.speculative_eagle_topk,
            self.speculative_num_draft_tokens,
        )
        max_running = self.max_running_requests
        if self.speculative:
            steps = _AUTO_SPEC_STEPS if steps is None else steps
            topk = _AUTO_SPEC_TOPK if topk is None else topk
            draft = _AUTO_SPEC_DRAFT_TOKENS if draft is None else draft
            max_running = SPEC_MAX_RUNNING_REQUESTS if max_running is None else max_running
        elif max_running is None:
            max_running = DEFAULT_MAX_RUNNING_REQUESTS
        return dataclasses.replace(
            self,
            served_model_name=self.model_name,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=draft,
            max_running_requests=max_running,
        )

    def as_dict(self) -> dict[str, Any]:
        """Flat like SGLang's `dataclasses.asdict(server_args)`; recorded flags sit beside
        the known ones, which win on a name clash."""
        known = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del known["recorded"]
        return {**self.recorded, "tokenizer_path": self.model_path, **known}


def _parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: an unknown flag that happens to be a prefix of a known one
    # (SGLang has hundreds) must be recorded, not silently taken for the known one.
    p = argparse.ArgumentParser(
        prog="python -m supervisor.standin",
        description="SGLang stand-in (see docs/standin.md). Unknown flags are recorded.",
        allow_abbrev=False,
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-init-addr", default=None)
    return p


def _coerce(value: str) -> Scalar:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _snake(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def record_unknown(extras: Sequence[str]) -> dict[str, Recorded]:
    """Turn parse_known_args' leftovers into {snake_name: value}.

    `--x v` -> v, `--x=v` -> v, bare `--x` -> True, `--x a b` -> [a, b]. A leftover that is
    not a flag and follows none (a stray positional) is kept under "_positional".
    """
    recorded: dict[str, Recorded] = {}
    name: str | None = None
    values: list[Scalar] = []

    def flush() -> None:
        if name is not None:
            recorded[name] = True if not values else values[0] if len(values) == 1 else values

    for token in extras:
        if token.startswith("--"):
            flush()
            flag, eq, value = token.partition("=")
            name, values = _snake(flag), ([_coerce(value)] if eq else [])
        elif name is None:
            stray = recorded.setdefault("_positional", [])
            assert isinstance(stray, list)
            stray.append(token)
        else:
            values.append(_coerce(token))
    flush()
    return recorded


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """Parse like SGLang (exit 2 with a usage message on a bad known flag)."""
    known, extras = _parser().parse_known_args(argv)
    return ServerArgs(recorded=record_unknown(extras), **vars(known))


def api_key_of(args: ServerArgs) -> str | None:
    """The key the server requires, as SGLang 0.5.23 takes it: `--api-key K`, or `api-key: K`
    in the YAML file `--config FILE` names (srt/server_args.py:402,
    srt/utils/server_args_config_parser.py:75; the command line wins). None: no key."""
    key = args.recorded.get("api_key")
    if key is None and isinstance(args.recorded.get("config"), str):
        import yaml

        try:
            with open(str(args.recorded["config"]), encoding="utf-8") as f:
                doc = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as exc:
            raise SystemExit(f"cannot read --config {args.recorded['config']}: {exc}") from None
        key = doc.get("api-key", doc.get("api_key")) if isinstance(doc, dict) else None
    return None if key is None or key is True else str(key)
