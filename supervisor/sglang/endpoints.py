"""SGLang's read-only endpoints, each fetched and parsed in one place.

- `/metrics` (Prometheus text, with `--enable-metrics`): `fetch_metrics` reads it (uncompressed,
  capped), `parse_metrics` turns it into samples once (`samples`: off the loop); `total` and
  `mean` read them. The probe's busy detection (`probe.parse_progress`), the drain's wait
  (`drain_wait.parse_load`) and serving quality's gauges (`quality.parse_gauge`) all read
  through `parse_metrics`.
- `/server_info` (or `/get_server_info`, its older name): `server_info`, bounded and decoded as
  an untrusted answer (supervisor/untrusted.py), used for the intent check and the golden's key.
- `/generate` (the decode probe, the canary): `post_generate`, one total deadline and a capped
  read of the answer; `/abort_request`: `abort`, for a request that timed out.

Never raises: an answer that cannot be had or read is None.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Mapping
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from supervisor import threads, untrusted

Samples = Mapping[str, list[tuple[Mapping[str, str], float]]]

INFO_PATHS = ("/server_info", "/get_server_info")
# SGLang 0.5.23's /server_info is a few KiB (its arguments and internal states); more is not
# that answer, and is not read into the daemon's memory.
MAX_INFO_BYTES = 1 << 20
MAX_ANSWER_BYTES = 1 << 20  # a probe or canary answer is a few KiB; more is not that answer
# SGLang's /metrics page, read as sent (never gzip: httpx inflates without bound) and at most
# this much. Sized from real pages (docs/security.md, "Answers read from SGLang"): real SGLang
# 0.5.23's page is tens of KiB, a tp-8 server's scheduler families repeat once per rank with a
# `tp_rank` label; 8 MiB is over 20 times the largest such page.
MAX_METRICS_BYTES = 8 << 20
# A page is parsed off the loop: pure Python, so the loop keeps its share of the GIL.
PARSE_TIMEOUT_S = 10.0
ABORT_TIMEOUT_S = 2.0


def parse_metrics(text: str) -> Samples | None:
    """Every sample of a Prometheus text page by its name (`..._total` kept), with its labels;
    None when the text is not one (whatever the parser raises on a hostile text)."""
    out: dict[str, list[tuple[Mapping[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append((sample.labels, sample.value))
    except Exception:
        return None
    return out


def total(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of `name` over its label sets (those with all of `labels`), None if absent."""
    found = [
        v for got, v in samples.get(name, ()) if all(got.get(k) == w for k, w in labels.items())
    ]
    return sum(found) if found else None


def mean(samples: Samples, name: str) -> float | None:
    """The mean of a gauge over its label sets (finite values only), None if absent."""
    found = [v for _, v in samples.get(name, ()) if math.isfinite(v)]
    return statistics.fmean(found) if found else None


async def get_metrics(
    client: httpx.AsyncClient, base_url: str, timeout: float = 2.0
) -> tuple[str | None, str | None]:
    """(SGLang's /metrics exposition, None), or (None, why it cannot be had within `timeout`):
    asked for uncompressed and read through `untrusted.read_capped` (MAX_METRICS_BYTES)."""
    url = base_url.rstrip("/") + "/metrics"
    try:
        async with asyncio.timeout(timeout):
            async with client.stream(
                "GET", url, timeout=timeout, headers={"Accept-Encoding": "identity"}
            ) as r:
                if r.status_code == 404:
                    return None, "SGLang's /metrics is not served (start it with --enable-metrics)"
                if r.status_code != 200:
                    return None, f"SGLang's /metrics answered HTTP {r.status_code}"
                body = await untrusted.read_capped(r, MAX_METRICS_BYTES)
    except (TimeoutError, httpx.HTTPError, OSError) as exc:
        return None, f"SGLang's /metrics did not answer ({type(exc).__name__})"
    except untrusted.BadAnswer as exc:
        return None, f"SGLang's /metrics: {exc}"
    return body.decode("utf-8", "replace"), None


async def fetch_metrics(
    client: httpx.AsyncClient, base_url: str, timeout: float = 2.0
) -> str | None:
    """SGLang's /metrics exposition, or None when it does not answer 200 within `timeout`."""
    return (await get_metrics(client, base_url, timeout))[0]


async def samples(text: str) -> Samples | None:
    """`parse_metrics` in a thread: a large page costs the loop only its share of the GIL."""
    try:
        return await threads.in_thread(lambda: parse_metrics(text), PARSE_TIMEOUT_S)
    except TimeoutError:
        return None


async def fetch_samples(
    client: httpx.AsyncClient, base_url: str, timeout: float = 2.0
) -> Samples | None:
    """SGLang's /metrics, parsed (`samples`), or None."""
    text = await fetch_metrics(client, base_url, timeout)
    return None if text is None else await samples(text)


async def server_info(
    http: httpx.AsyncClient, base_url: str, timeout: float = 10.0
) -> dict[str, Any] | None:
    """SGLang's resolved arguments (docs/sglang.md, "Endpoints"), or None: for no answer, an
    answer over MAX_INFO_BYTES, or one that is not a JSON object, whatever it holds."""
    headers = {"Accept-Encoding": "identity"}
    for path in INFO_PATHS:
        try:
            async with asyncio.timeout(timeout):
                url = base_url.rstrip("/") + path
                async with http.stream("GET", url, headers=headers, timeout=timeout) as r:
                    if r.status_code != 200:
                        continue
                    doc = untrusted.loads(await untrusted.read_capped(r, MAX_INFO_BYTES))
        except Exception:  # any failure to fetch or decode is "no answer"
            continue
        if isinstance(doc, dict):
            return doc
    return None


async def post_generate(
    client: httpx.AsyncClient, base_url: str, path: str, body: Mapping[str, Any], limit: float
) -> tuple[int, bytes]:
    """POST a generate request: (HTTP status, the raw answer).

    One total deadline (`limit`): httpx's own timeouts are per read, so a server that trickles
    a byte at a time would otherwise keep the request alive forever. The answer is asked for as
    sent (`identity`) and read through `untrusted.read_capped`: untrusted.BadAnswer past
    MAX_ANSWER_BYTES (declared or sent) or for an encoded answer. Raises TimeoutError and
    httpx's errors too: the caller's verdict.
    """
    async with asyncio.timeout(limit):
        async with client.stream(
            "POST",
            base_url.rstrip("/") + path,
            json=body,
            timeout=limit,
            headers={"Accept-Encoding": "identity"},
        ) as response:
            return response.status_code, await untrusted.read_capped(response, MAX_ANSWER_BYTES)


async def abort(
    client: httpx.AsyncClient, base_url: str, rid: str, timeout: float = ABORT_TIMEOUT_S
) -> bool:
    """POST /abort_request {"rid": rid}: SGLang stops the request wherever it is (waiting or
    running). A probe that gave up waiting would otherwise keep decoding inside SGLang, and
    timed-out probes would pile up (sglang #35884). True when SGLang answered 200."""
    try:
        async with asyncio.timeout(timeout):
            r = await client.post(
                base_url.rstrip("/") + "/abort_request", json={"rid": rid}, timeout=timeout
            )
    except (TimeoutError, httpx.HTTPError, OSError):
        return False
    return r.status_code == 200
