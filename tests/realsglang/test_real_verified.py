"""Verified changes against the real SGLang 0.5.23 server, serving the confident canary model
(tools/make-canary-model). One daemon for the whole module, its launches in file order:

1. launch 1 has no golden: its answer is checked against the known answers (three lines of the
   corpus passage the canary model learnt by heart) before it is learned;
2. 100 known-answer checks straight against that server, as the daemon makes them, at idle,
   right after the same prompt (a radix-cache hit) and under 3 concurrent generations: zero
   false alarms;
3. a reload makes every decode batch sleep (the fault hook's slow-decode) so that an 8-token
   probe answers within its timeout and the 16-token canary never does: never ready, restarted
   as `canary_unavailable` after 3 tries.

The figures for docs/benchmarks.md are printed with -s ([realsglang] lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from supervisor.quality import holds, known_tokens
from supervisor.quality.asking import ask
from supervisor.quality.golden import CanaryStore
from testkit import realsglang as real
from testkit.daemon import log_time
from testkit.realsglang import Real, daemon_config, generate, real_daemon, report
from testkit.wait import wait_until

pytestmark = pytest.mark.timeout(1500)

# Lines of the passage (tools/sglang-env.d/corpus.txt 31-80) and how the canary model goes on.
KNOWN = [
    {"prompt": "Everything that happens becomes an event", "expect": "on one `asyncio.Queue`:"},
    {"prompt": "1. SGLang (launch 1) binds its", "expect": "port. The port"},
    {"prompt": "daemon turns that into one structured", "expect": "log event, the"},
]
SLOW_S = 1.0  # per decode batch: an 8-token probe takes 7 s and more, a 16-token canary 15 s
PROBE_TIMEOUT = "11s"  # the canary's too (quality_watch: min(30 s, the probe's))


@pytest.fixture(scope="module")
def served(canary_sgl: real.SGLangEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    tmp = tmp_path_factory.mktemp("verified")
    cfg = daemon_config(
        tmp,
        canary_sgl,
        quality={
            "canary": {"prompt": real.CANARY_PROMPT, "max_tokens": real.CANARY_TOKENS},
            "known_answers": KNOWN,
        },
        readiness={"load_timeout": "900s"},
    )
    with real_daemon(tmp, cfg) as r:
        yield r


def test_the_first_golden_is_verified_by_the_known_answers(served: Real) -> None:
    ready = served.wait_ready(900)
    assert ready["reason"] == "probe_ok"
    canary = served.d.status()["quality"]["canary"]
    assert canary["state"] == "learned"
    assert [k["ok"] for k in canary["known_answers"]] == [True, True, True]
    (golden,) = CanaryStore(str(served.tmp / "state" / "canary")).goldens()
    assert golden.known_ok and len(golden.known) == 3


def _load(url: str, stop: threading.Event, i: int) -> None:
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            generate(url, 48, text=f"Story {i}: once upon a time", timeout=120)


def test_no_false_alarm_over_a_hundred_known_answers(served: Real) -> None:
    url = served.sglang_url
    results: dict[str, list[bool]] = {"idle": [], "radix": [], "load": []}
    counts = {"idle": 34, "radix": 33, "load": 33}

    async def run() -> None:
        async with httpx.AsyncClient(trust_env=False) as http:
            for phase, n in counts.items():
                stop = threading.Event()
                loads = [
                    threading.Thread(target=_load, args=(url, stop, i))
                    for i in range(3 if phase == "load" else 0)
                ]
                for t in loads:
                    t.start()
                try:
                    for i in range(n):
                        known = KNOWN[i % len(KNOWN)]
                        tokens = known_tokens(known["expect"])
                        if phase == "radix":
                            generate(url, tokens, text=known["prompt"])
                        got, _ = await ask(http, url, known["prompt"], tokens, 120.0)
                        assert not isinstance(got, str), got
                        if phase == "radix":
                            assert got.cached_tokens, "the prompt was not a cache hit"
                        results[phase].append(holds(known["expect"], got.text))
                finally:
                    stop.set()
                    for t in loads:
                        t.join()

    asyncio.run(run())
    total = sum(len(v) for v in results.values())
    alarms = sum(not ok for v in results.values() for ok in v)
    report("known answers checked", total, "answers")
    report("known-answer false alarms", alarms, "answers")
    assert total == 100 and alarms == 0, results


def _ready(r: Real) -> bool:
    try:
        return r.readyz() == 200
    except httpx.HTTPError:
        return False  # the admin endpoint is not up yet


def test_never_ready_on_a_timed_out_canary(served: Real) -> None:
    wait_until(lambda: _ready(served), 900, "ready", interval=0.5)  # when run alone

    def slow(c: dict[str, Any]) -> None:
        c["sglang"]["env"].update(real.slow_decode_env(SLOW_S))
        c["readiness"]["probe"]["timeout"] = PROBE_TIMEOUT

    served.rewrite(slow)
    served.d.signal(signal.SIGHUP)
    assert served.d.wait_state("restarting", 240)["reason"] == "reload"
    warming = served.d.wait_state("warming", 900)
    tries = [served.d.wait_reason("canary_unavailable", 300, new="warming") for _ in range(2)]
    assert f"no canary answer within {PROBE_TIMEOUT[:-1]}s (1/3)" in tries[0]["detail"]
    restart = served.d.wait_reason("canary_unavailable", 300)
    assert restart["new"] == "restarting" and "(3/3)" in restart["detail"]
    report("slow launch: port open -> canary_unavailable", log_time(restart) - log_time(warming))
    states = [e for e in served.d.seen if e.get("event") == "state"]
    since = max(i for i, e in enumerate(states) if e.get("reason") == "reload")
    assert "ready" not in [e["new"] for e in states[since:]]
    served.d.wait_state("cleaning", 120)  # the restart is recorded once the old launch is gone
    st = served.d.status()
    assert st["last_restart"]["reason"] == "canary_unavailable"
    assert st["last_restart"]["incident"]
