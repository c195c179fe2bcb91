"""bench.loadgen through the real router: what it counts must match what happened."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
from aiohttp import web

from bench.loadgen import CUT, STREAM_OK, LoadGenerator, stream_complete
from testkit.loopback import serve_app
from testkit.router import RouterProcess, make_link, served
from testkit.standin import Launcher
from testkit.wait import wait_until_async


async def test_plain_load_through_the_router_with_a_replica_taken_out_first(
    router: RouterProcess, launch: Launcher
) -> None:
    a, b = launch(), launch()
    async with httpx.AsyncClient(trust_env=False) as client:
        la, _, _ = make_link(client, router.url, a.url(""))
        lb, _, _ = make_link(client, router.url, b.url(""))
        load = LoadGenerator(router.url, concurrency=3, stream_every=0, max_new_tokens=4)
        try:
            la.want_registered()
            lb.want_registered()
            await wait_until_async(
                lambda: la.state.registered and lb.state.registered, 15.0, "both registered"
            )
            await load.start()
            await load.wait_for(20)
            at = load.mark("b out")
            lb.begin_deregister("restart", wait_idle=True)
            await lb.settled()
            b_count = served(b)
            b.cleanup()  # stopped only after it is out and idle
            await load.wait_for(len(load.outcomes) + 20)
        finally:
            stats = await load.stop()
            la.begin_deregister("cleanup")
            await la.close()
            await lb.close()
    assert stats.sent >= 40 and stats.failed == 0, stats.to_dict()
    after = load.stats(since=at)
    assert after.sent >= 20 and after.ok == after.sent
    assert served(b) == b_count  # nothing reached b once it was out
    await wait_until_async(lambda: served(a) + served(b) >= stats.ok, 15.0, "a's log to catch up")


def test_stream_complete_reads_sglangs_end_markers() -> None:
    assert stream_complete([b' {"text": "a", "meta_info": {"finish_reason": null}}', b" [DONE]"])
    assert stream_complete([b'{"text":"ab","meta_info":{"finish_reason":{"type":"length"}}}'])
    assert not stream_complete([b'{"text": "a", "meta_info": {"finish_reason": null}}'])
    assert not stream_complete([])


# A streaming server only for the client's side of streams: the stand-in does not stream.
async def _sse(cut: bool) -> tuple[str, Callable[[], Awaitable[None]]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"text": "a", "meta_info": {"finish_reason": null}}\n\n')
        if cut:
            assert request.transport is not None
            request.transport.close()  # as when SGLang is killed mid-stream
            return resp
        await resp.write(
            b'data: {"text": "ab", "meta_info": {"finish_reason": {"type": "length"}}}\n\n'
        )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", handler)
    return await serve_app(app)


async def test_streams_cut_and_completed_are_told_apart() -> None:
    for cut, expected in ((False, STREAM_OK), (True, CUT)):
        url, stop = await _sse(cut)
        load = LoadGenerator(url, concurrency=1, stream_every=1, timeout=5)
        try:
            await load.start()
            await load.wait_for(3)
        finally:
            stats = await load.stop()
            await stop()
        assert {o.result for o in load.outcomes} == {expected}, load.outcomes[:3]
        assert (stats.streams_cut > 0) is cut and stats.failed == 0
