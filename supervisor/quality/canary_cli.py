"""`kimi-serve canary show|accept|forget`: the golden answers under <state_dir>/canary/.

The daemon reads the golden again at every canary, so `accept` and `forget` take effect at the
next one (the next launch's readiness, or the next interval) without a restart.
"""

from __future__ import annotations

import datetime
import json
from typing import TextIO

from supervisor.exits import EX_NOTHING, EX_OK
from supervisor.quality import checked_prefix
from supervisor.quality.golden import CanaryStore, Golden


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _describe(g: Golden, out: TextIO, title: str) -> None:
    a = g.answer
    print(f"{title} {g.key} ({g.how} {_when(g.learned_at)})", file=out)
    print(f"  model      {g.model_path} (identity {g.identity[:16]})", file=out)
    print(f"  sglang     {g.sglang_version}", file=out)
    print(f"  prompt     {g.prompt!r}, {g.max_tokens} tokens", file=out)
    print(f"  answer     {a.text!r}", file=out)
    print(f"  confident  {checked_prefix(a)} of {len(a.tokens)} tokens compared", file=out)
    if a.tokens_per_second:
        print(f"  decode     {a.tokens_per_second:.1f} tokens/s", file=out)


def run(action: str, directory: str, as_json: bool, out: TextIO, err: TextIO) -> int:
    store = CanaryStore(directory)
    if action == "show":
        goldens, last = store.goldens(), store.last()
        if as_json:
            doc = {
                "dir": directory,
                "goldens": [g.to_json() for g in goldens],
                "last": None if last is None else last.to_json(),
            }
            print(json.dumps(doc, indent=2), file=out)
            return EX_OK
        if not goldens:
            print(
                f"no golden answer under {directory}: the next verified launch learns it", file=out
            )
        for g in goldens:
            _describe(g, out, "golden")
        if last is not None:
            _describe(last, out, "last received")
        return EX_OK
    if action == "accept":
        try:
            accepted = store.accept()
        except OSError as exc:
            print(f"kimi-serve canary accept: cannot write under {directory}: {exc}", file=err)
            return EX_NOTHING
        if accepted is None:
            print(
                f"kimi-serve canary accept: no canary answer received yet under {directory}",
                file=err,
            )
            return EX_NOTHING
        print(f"accepted {accepted.answer.text!r} as the golden answer {accepted.key}", file=out)
        return EX_OK
    try:
        removed = store.forget()
    except OSError as exc:
        print(f"kimi-serve canary forget: cannot remove under {directory}: {exc}", file=err)
        return EX_NOTHING
    print(f"forgot {len(removed)} golden answer(s); the next verified launch learns it", file=out)
    return EX_OK
