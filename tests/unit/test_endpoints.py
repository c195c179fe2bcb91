"""supervisor.sglang.endpoints: SGLang's /metrics parsed once, /server_info bounded; and the
quality watch's SGLang version read through the same bounded fetch."""

from __future__ import annotations

import httpx

from supervisor.daemon.quality_watch import sglang_version
from supervisor.sglang import endpoints

PAGE = (
    "# TYPE sglang:realtime_tokens_total counter\n"
    'sglang:realtime_tokens_total{mode="prefill",tp_rank="0"} 10\n'
    'sglang:realtime_tokens_total{mode="decode",tp_rank="0"} 5\n'
    'sglang:realtime_tokens_total{mode="decode",tp_rank="1"} 7\n'
    "# TYPE sglang:spec_accept_length gauge\n"
    'sglang:spec_accept_length{tp_rank="0"} 2.0\n'
    'sglang:spec_accept_length{tp_rank="1"} 3.0\n'
)


def test_samples_are_summed_or_averaged_by_name_and_labels() -> None:
    samples = endpoints.parse_metrics(PAGE)
    assert samples is not None
    assert endpoints.total(samples, "sglang:realtime_tokens_total") == 22.0
    assert endpoints.total(samples, "sglang:realtime_tokens_total", mode="decode") == 12.0
    assert endpoints.total(samples, "sglang:num_running_reqs") is None
    assert endpoints.mean(samples, "sglang:spec_accept_length") == 2.5
    assert endpoints.mean(samples, "sglang:num_queue_reqs") is None


def test_a_page_that_is_not_prometheus_text_is_none() -> None:
    assert endpoints.parse_metrics("{{{ not prometheus") is None
    assert endpoints.parse_metrics("") == {}


def transport(body: bytes, status: int = 200) -> httpx.AsyncClient:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, stream=httpx.ByteStream(body))

    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


async def test_server_info_is_a_json_object_within_the_cap() -> None:
    async with transport(b'{"version": "0.5.23"}') as http:
        assert await endpoints.server_info(http, "http://sglang") == {"version": "0.5.23"}
        assert await sglang_version(http, "http://sglang") == "0.5.23"
    async with transport(b"[1, 2]") as http:
        assert await endpoints.server_info(http, "http://sglang") is None
    async with transport(b'{"version": "x"}', status=500) as http:
        assert await endpoints.server_info(http, "http://sglang") is None


async def test_an_answer_over_the_cap_is_not_read() -> None:
    huge = b'{"version": "0.5.23", "pad": "' + b"x" * endpoints.MAX_INFO_BYTES + b'"}'
    async with transport(huge) as http:
        assert await endpoints.server_info(http, "http://sglang") is None
        assert await sglang_version(http, "http://sglang") == "unknown"
