"""`kimi-serve canary show|accept|forget|try`: the golden answers under <state_dir>/canary/, and
the known answers (quality.known_answers) asked of the running model.

The daemon reads the golden again at every canary, so `accept` and `forget` take effect at the
next one (the next launch's readiness, or the next interval) without a restart. None of the
commands can enshrine a wrong answer by accident: `accept` shows what it would accept and how
the known answers fared, asks (`--yes` for scripts), and refuses an answer that failed them
unless `--force`; `forget` forgets the received answer too, so `accept` cannot put it back.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from typing import Any, TextIO

from supervisor import terminal
from supervisor.config import Config
from supervisor.exits import EX_CONFIG, EX_NOTHING, EX_OK, EX_REFUSED, EX_UNREACHABLE
from supervisor.quality import KnownResult, checked_prefix, compare
from supervisor.quality.golden import CanaryStore, Golden, default_dir

ACTIONS = ("show", "accept", "forget", "try")


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("--json", action="store_true", help="print JSON (show, try)")
    p.add_argument("--yes", action="store_true", help="accept without asking (scripts)")
    p.add_argument(
        "--force", action="store_true", help="accept an answer that failed the known answers"
    )


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _describe(g: Golden, out: TextIO, title: str) -> None:
    a = g.answer
    shown = terminal.shown  # the store's file and SGLang's version are untrusted text
    print(f"{title} {shown(g.key)} ({shown(g.how)} {_when(g.learned_at)})", file=out)
    print(f"  model      {shown(g.model_path)} (identity {shown(g.identity[:16])})", file=out)
    print(f"  sglang     {shown(g.sglang_version)}", file=out)
    print(f"  prompt     {g.prompt!r}, {g.max_tokens} tokens", file=out)
    print(f"  answer     {a.text!r}", file=out)
    print(f"  confident  {checked_prefix(a)} of {len(a.tokens)} tokens compared", file=out)
    if a.tokens_per_second:
        print(f"  decode     {a.tokens_per_second:.1f} tokens/s", file=out)
    if g.verified_against:
        print(f"  verified   against the golden {g.verified_against}", file=out)
    for k in g.known:
        print(f"  known      {'ok  ' if k.ok else 'FAIL'} {k.detail()}", file=out)


def differs(goldens: list[Golden], last: Golden | None) -> str | None:
    """How the last received answer differs from the golden of its key, or None (the same, or
    no golden to differ from)."""
    if last is None:
        return None
    golden = next((g for g in goldens if g.key == last.key), None)
    if golden is None:
        return None
    verdict = compare(golden.answer, last.answer)
    return None if verdict.match else verdict.detail(golden.answer, last.answer)


def _show(store: CanaryStore, directory: str, as_json: bool, out: TextIO) -> int:
    goldens, last = store.goldens(), store.last()
    diff = differs(goldens, last)
    if as_json:
        doc: dict[str, Any] = {
            "dir": directory,
            "goldens": [g.to_json() for g in goldens],
            "last": None if last is None else {**last.to_json(), "differs": diff},
        }
        print(json.dumps(doc, indent=2), file=out)
        return EX_OK
    if not goldens:
        print(f"no golden answer under {directory}: the next verified launch learns it", file=out)
    for g in goldens:
        _describe(g, out, "golden")
    if last is not None:
        _describe(last, out, "last received")
        if diff is not None:
            print(f"  DIFFERS from the golden of its key: {diff}", file=out)
    return EX_OK


def _confirmed(question: str, stdin: TextIO, out: TextIO) -> bool:
    print(f"{question} [y/N] ", end="", file=out, flush=True)
    try:
        reply = stdin.readline()
    except (OSError, ValueError):
        return False
    return reply.strip().lower() in ("y", "yes")


def _accept(
    store: CanaryStore, cfg: Config, args: argparse.Namespace, io: tuple[TextIO, TextIO, TextIO]
) -> int:
    stdin, out, err = io
    directory = default_dir(cfg.state_dir)
    last = store.last()
    if last is None:
        print(
            f"kimi-serve canary accept: no canary answer received yet under {directory}", file=err
        )
        return EX_NOTHING
    _describe(last, out, "would accept")
    asked = {(k.prompt, k.expect) for k in last.known}
    unasked = [p for p, e in cfg.quality.known_answers if (p, e) not in asked]
    for prompt in unasked:
        print(f"  known      FAIL known answer to {prompt!r}: not asked of this answer", file=out)
    if not cfg.quality.known_answers and not last.known:
        print("  known      none configured (quality.known_answers)", file=out)
    diff = differs(store.goldens(), last)
    if diff is not None:
        print(f"  replaces   the golden of its key, which it differs from: {diff}", file=out)
    if (unasked or not last.known_ok) and not args.force:
        print(
            "kimi-serve canary accept: refused: the answer failed the known answers "
            "(--force accepts it all the same)",
            file=err,
        )
        return EX_REFUSED
    if not args.yes and not _confirmed("accept this answer as the golden?", stdin, out):
        print("kimi-serve canary accept: not accepted (--yes accepts without asking)", file=err)
        return EX_REFUSED
    try:
        accepted = store.accept(last)
    except OSError as exc:
        print(f"kimi-serve canary accept: cannot write under {directory}: {exc}", file=err)
        return EX_NOTHING
    if accepted is None:
        return EX_NOTHING
    print(f"accepted {accepted.answer.text!r} as the golden answer {accepted.key}", file=out)
    return EX_OK


def _forget(store: CanaryStore, directory: str, out: TextIO, err: TextIO) -> int:
    try:
        removed = store.forget()
    except OSError as exc:
        print(f"kimi-serve canary forget: cannot remove under {directory}: {exc}", file=err)
        return EX_NOTHING
    goldens = [n for n in removed if n.startswith("golden-")]
    also = " and the last received answer" if len(goldens) < len(removed) else ""
    print(
        f"forgot {len(goldens)} golden answer(s){also}; the next verified launch learns it",
        file=out,
    )
    return EX_OK


def _try(cfg: Config, as_json: bool, out: TextIO, err: TextIO) -> int:
    """Ask the running model the known answers (and the canary's prompt), print the answers."""
    import httpx

    from supervisor.quality import known_tokens
    from supervisor.quality.asking import ask
    from supervisor.sglang import api_key as sglang_key
    from supervisor.sglang.probe import server_url

    url = server_url(cfg.sglang.host, cfg.sglang.port)
    try:
        auth = sglang_key.auth_for(cfg, url, owners=())
    except sglang_key.KeyFileError as exc:
        print(f"error: sglang.api_key_file: {exc}", file=err)
        return EX_CONFIG
    ccfg = cfg.quality.canary
    timeout = max(cfg.readiness.probe.timeout, 5.0)
    asked = [(ccfg.prompt, None, ccfg.max_tokens)] + [
        (p, e, known_tokens(e)) for p, e in cfg.quality.known_answers
    ]

    async def run() -> list[tuple[str, str | None, str | None, str]]:
        rows: list[tuple[str, str | None, str | None, str]] = []
        async with httpx.AsyncClient(trust_env=False, auth=auth) as http:
            for prompt, expect, n in asked:
                got, _ = await ask(http, url, prompt, n, timeout)
                if isinstance(got, str):
                    rows.append((prompt, expect, None, got))
                else:
                    rows.append((prompt, expect, got.text, ""))
        return rows

    rows = asyncio.run(run())
    results = [KnownResult(p, e, g, error) for p, e, g, error in rows if e is not None]
    if as_json:
        doc = {
            "url": url,
            "canary": {"prompt": rows[0][0], "got": rows[0][2], "error": rows[0][3] or None},
            "known_answers": [{**k.to_json(), "error": k.error or None} for k in results],
        }
        print(json.dumps(doc, indent=2), file=out)
    else:
        prompt, _, got, error = rows[0]
        print(f"canary  {prompt!r} -> {got!r}" if got is not None else f"canary  {error}", file=out)
        for k in results:
            print(f"known   {'ok  ' if k.ok else 'FAIL'} {k.detail()}", file=out)
        if not results:
            print(
                "no quality.known_answers configured: adopt answers you have reviewed, e.g.\n"
                f"  quality:\n    known_answers:\n      - {{prompt: {prompt!r}, expect: ...}}",
                file=out,
            )
    if any(got is None for _, _, got, _ in rows):
        return EX_UNREACHABLE
    return EX_OK if all(k.ok for k in results) else EX_REFUSED


def run(args: argparse.Namespace, cfg: Config, stdin: TextIO, out: TextIO, err: TextIO) -> int:
    directory = default_dir(cfg.state_dir)
    store = CanaryStore(directory)
    match args.action:
        case "show":
            return _show(store, directory, args.json, out)
        case "accept":
            return _accept(store, cfg, args, (stdin, out, err))
        case "forget":
            return _forget(store, directory, out, err)
        case _:
            return _try(cfg, args.json, out, err)
