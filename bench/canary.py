"""`python -m bench canary`: how stable greedy text is on the real SGLang 0.5.23 server (CPU).

    SGLANG_ENV_DIR=/path/to/env .venv/bin/python -m bench canary [--n 100] [--json F]

The figures a canary comparison is designed on (docs/realsglang.md quotes them). For each of
the tiny random model (tools/make-tiny-model) and the confident canary model
(tools/make-canary-model), one real server (testkit/realsglang.py), and on it `--n`
greedy generations of the canary prompt (`/generate`, temperature 0, max_new_tokens 16,
ignore_eos, return_logprob with top_logprobs_num 2) in three conditions:

- `idle`: /flush_cache before each request, so each one prefills the whole prompt;
- `repeat`: the same prompt again at once, without a flush (a radix-cache hit:
  meta_info.cached_tokens > 0);
- `load`: while 3 other clients generate other texts (64 tokens each, one after another), so
  the canary shares its decode batches with them.

Per condition: how many texts differ from the first idle answer, the first position where they
differ, per position the smallest top-1 minus top-2 logprob seen (nats), and the largest
change of a chosen token's logprob against the first answer (before any difference). Then
servers with KIMI_TEST_FAULT=perturbed-weights (tests/realsglang/faulthook; seed 0): the tiny
model at 0.5 x std, the canary model at 0.5 and at 1 x std: does the greedy text differ, from
which position, by how many of the 16 tokens, and how far its logprobs moved.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import parser
from testkit import realsglang as real

TOKENS = real.CANARY_TOKENS
START_TIMEOUT = 600.0  # a launch took over 180 s with other jobs on the two cores
# (result name, model, noise scale x std): seed 0 each time (real.perturbed_env).
PERTURBED = (
    ("tiny_perturbed_0.5", "tiny", 0.5),
    ("canary_perturbed_0.5", "canary", 0.5),
    ("canary_perturbed_1", "canary", 1.0),
)
LOAD_TEXTS = (
    "The daemon reads the file, and runs preflight's config checks",
    "Blocking work (model-path checks before a launch",
    "Tell me a story.",
)


def generate(client: httpx.Client, url: str, text: str, tokens: int = TOKENS) -> dict[str, Any]:
    return real.greedy_answer(client, url, text, tokens)


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def drift(run: dict[str, Any], ref: dict[str, Any]) -> float:
    """Largest |logprob - reference logprob| of the chosen tokens, up to the first difference."""
    same = first_diff(run["ids"], ref["ids"])
    upto = len(ref["ids"]) if same is None else same
    pairs = list(zip(run["logprobs"][:upto], ref["logprobs"][:upto], strict=True))
    return max((abs(a - b) for a, b in pairs), default=0.0)


def _against(runs: list[dict[str, Any]], ref: dict[str, Any]) -> dict[str, Any]:
    """How many of `runs` differ from `ref`, and from which positions."""
    diffs = [first_diff(r["ids"], ref["ids"]) for r in runs]
    return {
        "n": len(runs),
        "texts_differing": sum(d is not None for d in diffs),
        "first_diff_positions": sorted({d for d in diffs if d is not None}),
    }


def condition(runs: list[dict[str, Any]], ref: dict[str, Any]) -> dict[str, Any]:
    per_pos = [min(r["margins"][i] for r in runs) for i in range(TOKENS)]
    return _against(runs, ref) | {
        "min_margin_per_position": [round(m, 4) for m in per_pos],
        "min_margin": round(min(per_pos), 4),
        "median_margin": round(sorted(m for r in runs for m in r["margins"])[len(runs) * 8], 4),
        "cache_hits": sum(r["cached_tokens"] > 0 for r in runs),
        "max_logprob_drift": round(max(drift(r, ref) for r in runs), 4),
    }


def measure(url: str, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with httpx.Client(trust_env=False) as client:
        client.post(url + "/flush_cache", timeout=60).raise_for_status()
        ref = generate(client, url, real.CANARY_PROMPT)
        out["reference"] = {k: ref[k] for k in ("text", "ids", "logprobs", "margins")}
        idle, repeat = [], []
        for _ in range(n):
            client.post(url + "/flush_cache", timeout=60).raise_for_status()
            idle.append(generate(client, url, real.CANARY_PROMPT))
            repeat.append(generate(client, url, real.CANARY_PROMPT))
        out["idle"] = condition(idle, ref)
        out["repeat"] = condition(repeat, ref)

        stop = threading.Event()
        background = [0]

        def other(text: str) -> None:
            with httpx.Client(trust_env=False) as c:
                while not stop.is_set():
                    generate(c, url, text, 64)
                    background[0] += 1

        threads = [threading.Thread(target=other, args=(t,), daemon=True) for t in LOAD_TEXTS]
        for t in threads:
            t.start()
        loaded = []
        try:
            for i in range(n):
                if i % 2 == 0:
                    client.post(url + "/flush_cache", timeout=60)  # refused while busy: fine
                loaded.append(generate(client, url, real.CANARY_PROMPT))
        finally:
            stop.set()
            for t in threads:
                t.join(300)
        out["load"] = condition(loaded, ref)
        out["load"]["background_requests"] = background[0]
    return out


def perturbed(url: str, ref: dict[str, Any], n: int = 5) -> dict[str, Any]:
    with httpx.Client(trust_env=False) as client:
        runs = [(generate(client, url, real.CANARY_PROMPT)) for _ in range(n)]
    return _against(runs, ref) | {
        "text": runs[0]["text"],
        "tokens_differing": [
            sum(a != b for a, b in zip(r["ids"], ref["ids"], strict=False)) for r in runs
        ],
        "self_consistent": len({tuple(r["ids"]) for r in runs}) == 1,
        "min_margin": round(min(m for r in runs for m in r["margins"]), 4),
        "max_logprob_drift": round(max(drift(r, ref) for r in runs), 4),
    }


def run(n: int, work: Path) -> dict[str, Any]:
    sgl = real.build_env()
    canary = real.canary_env(sgl)
    results: dict[str, Any] = {"n": n, "prompt": real.CANARY_PROMPT, "max_new_tokens": TOKENS}
    for name, env in (("tiny", sgl), ("canary", canary)):
        t0 = time.monotonic()
        with real.running(env, work / f"{name}.log", timeout=START_TIMEOUT) as srv:
            results[name] = measure(srv.url, n)
            results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"[canary] {name}: {json.dumps(summary_of(results[name]))}", file=sys.stderr)
    for name, model, scale in PERTURBED:
        base = results[model]["reference"]
        fault = real.perturbed_env(scale)
        log = work / f"{name}.log"
        which = canary if model == "canary" else sgl
        with real.running(which, log, env=fault, timeout=START_TIMEOUT) as srv:
            results[name] = perturbed(srv.url, base)
            results[name]["scale"] = scale
            results[name]["hook_line"] = "kimi-test-fault: perturbed-weights" in srv.log()
        print(f"[canary] {name}: {json.dumps(results[name])}", file=sys.stderr)
    return results


def summary_of(model: dict[str, Any]) -> dict[str, Any]:
    return {
        c: {k: model[c][k] for k in ("n", "texts_differing", "min_margin", "cache_hits")}
        for c in ("idle", "repeat", "load")
    }


def table(res: dict[str, Any]) -> str:
    head = (
        f"{'model/condition':<18} {'n':>4} {'texts differ':>12} {'cache hits':>10} "
        f"{'min margin':>10} {'median':>8} {'lp drift':>8}  first diff at"
    )
    out = [head]
    for model in ("tiny", "canary"):
        for c in ("idle", "repeat", "load"):
            r = res[model][c]
            out.append(
                f"{model + '/' + c:<18} {r['n']:>4} {r['texts_differing']:>12} "
                f"{r['cache_hits']:>10} {r['min_margin']:>10.4f} {r['median_margin']:>8.4f} "
                f"{r['max_logprob_drift']:>8.4f}  "
                f"{r['first_diff_positions'] or '-'}"
            )
    for model in ("tiny", "canary"):
        per_pos = res[model]["idle"]["min_margin_per_position"]
        out.append(f"{model} min margin per position (idle): {per_pos}")
    for name, _, _ in PERTURBED:
        p = res[name]
        out.append(
            f"{name}: {p['texts_differing']}/{p['n']} texts differ from the unperturbed answer, "
            f"first at {p['first_diff_positions'] or '-'}, tokens differing {p['tokens_differing']}"
            f", same answer every time: {p['self_consistent']}, min margin {p['min_margin']}, "
            f"logprob drift before the first difference {p['max_logprob_drift']}"
        )
    out.append(f"canary reference: {res['canary']['reference']['text']!r}")
    for name, model, _ in PERTURBED:
        if model == "canary":
            out.append(f"{name}: {res[name]['text']!r}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = parser("canary", __doc__, json_out=True)
    ap.add_argument("--n", type=int, default=100, help="generations per condition")
    ap.add_argument("--keep", type=Path, help="keep the servers' logs in this directory")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            work = args.keep
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-canary-")))
        res = run(args.n, work)
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
