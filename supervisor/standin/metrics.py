"""/metrics: a few of SGLang's Prometheus series, in the text format prometheus_client writes.

Names, types, help texts and label sets are SGLang 0.5.23's
(sglang/srt/observability/metrics_collector.py), as read from a real server's /metrics: the
scheduler's series carry `engine_type, model_name, moe_ep_rank, pp_rank, tp_rank` (and `mode`
for `realtime_tokens_total`); the tokenizer manager's counters and histograms carry
`engine_type, is_streaming, model_name`. Real SGLang serves this only with --enable-metrics;
the stand-in always does. Real SGLang writes no `_created` samples either.
"""

from __future__ import annotations

from supervisor.standin.engine import TTFT_BUCKETS, Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(pairs: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(name: str, kind: str, help_text: str, samples: list[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def render(engine: Engine) -> str:
    model = engine.args.model_name
    sched_pairs = {
        "engine_type": "unified",
        "model_name": model,
        "moe_ep_rank": "0",
        "pp_rank": "0",
        "tp_rank": "0",
    }
    tok_pairs = {"engine_type": "unified", "is_streaming": "false", "model_name": model}
    sched = _labels(sched_pairs)
    tok = _labels(tok_pairs)

    def gauge(name: str, help_text: str, value: float) -> list[str]:
        return _family(name, "gauge", help_text, [f"{name}{sched} {float(value)!r}"])

    def counter(name: str, help_text: str, value: float) -> list[str]:
        return _family(name, "counter", help_text, [f"{name}{tok} {float(value)!r}"])

    realtime = "sglang:realtime_tokens_total"
    realtime_samples = [
        f"{realtime}{_labels({**sched_pairs, 'mode': mode})} {float(value)!r}"
        for mode, value in (
            ("prefill_compute", engine.realtime_prefill_tokens),
            ("decode", engine.realtime_decode_tokens),
        )
    ]

    ttft = "sglang:time_to_first_token_seconds"
    buckets = [
        f"{ttft}_bucket{_labels({**tok_pairs, 'le': repr(float(b))})} {float(c)!r}"
        for b, c in zip(TTFT_BUCKETS, engine.ttft_counts, strict=True)
    ]
    buckets.append(
        f"{ttft}_bucket{_labels({**tok_pairs, 'le': '+Inf'})} {float(engine.ttft_count)!r}"
    )
    lines = [
        *gauge("sglang:num_running_reqs", "The number of running requests.", len(engine.running)),
        *gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", 0),
        *gauge(
            "sglang:gen_throughput", "The generation throughput (token/s).", engine.gen_throughput
        ),
        *gauge(
            "sglang:spec_accept_length",
            "Mean acceptance length of speculative decoding (accepted drafts + bonus token "
            "per forward).",
            engine.spec_accept_length,
        ),
        *_family(
            realtime,
            "counter",
            "Total number of tokens processed (updated on each log interval). mode: "
            "prefill_compute, prefill_cache, decode.",
            realtime_samples,
        ),
        *counter(
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            engine.prompt_tokens_total,
        ),
        *counter(
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            engine.generation_tokens_total,
        ),
        *_family(
            ttft,
            "histogram",
            "Histogram of time to first token in seconds.",
            [
                *buckets,
                f"{ttft}_count{tok} {float(engine.ttft_count)!r}",
                f"{ttft}_sum{tok} {engine.ttft_sum!r}",
            ],
        ),
    ]
    return "\n".join(lines) + "\n"
