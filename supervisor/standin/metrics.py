"""/metrics: a few of SGLang's Prometheus series, in the text format prometheus_client writes.

Names, help texts and label sets are SGLang's (sglang/srt/metrics/collector.py): scheduler
gauges carry `model_name, engine_type, tp_rank, pp_rank`; the tokenizer manager's counters and
histograms carry `model_name` only. Real SGLang serves this only with --enable-metrics; the
stand-in always does. The `_created` samples prometheus_client adds are left out.
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
    sched = _labels({"model_name": model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"})
    tok = _labels({"model_name": model})

    def gauge(name: str, help_text: str, value: float) -> list[str]:
        return _family(name, "gauge", help_text, [f"{name}{sched} {float(value)!r}"])

    def counter(name: str, help_text: str, value: float) -> list[str]:
        return _family(name, "counter", help_text, [f"{name}{tok} {float(value)!r}"])

    ttft = "sglang:time_to_first_token_seconds"
    buckets = [
        f"{ttft}_bucket{_labels({'le': repr(float(b)), 'model_name': model})} {float(c)!r}"
        for b, c in zip(TTFT_BUCKETS, engine.ttft_counts, strict=True)
    ]
    buckets.append(
        f"{ttft}_bucket{_labels({'le': '+Inf', 'model_name': model})} {float(engine.ttft_count)!r}"
    )
    lines = [
        *gauge("sglang:num_running_reqs", "The number of running requests.", len(engine.running)),
        *gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", 0),
        *gauge(
            "sglang:gen_throughput", "The generation throughput (token/s).", engine.gen_throughput
        ),
        *gauge(
            "sglang:spec_accept_length",
            "The average acceptance length of speculative decoding.",
            engine.spec_accept_length,
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
