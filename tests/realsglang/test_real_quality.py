"""Serving quality against the real SGLang 0.5.23 server, serving the confident canary model
(tools/make-canary-model). One daemon for the whole module, its launches in file order:

1. launch 1 learns the golden answer; a manual restart: launch 2 matches it;
2. the canary model is confident: launch 2's greedy answer has a margin of over 1 nat at
   every one of its 16 positions (the reference answer of steps 4 and 6);
3. 100+ canaries against launch 2, at idle, right after the same prompt (a radix-cache hit)
   and under concurrent load, compared as the daemon compares: zero false alarms; the daemon's
   own canaries (every 2 s meanwhile) raise none either;
4. decode slowed (the fault hook's slow-decode, switched on by a file): the server's own
   answers get slower by at least the hook's sleeps and keep their text, the hook says so in
   the log, slow_decode is reported, no restart; removed: fast again, and it clears;
5. a reload adds perturbed weights to the primary profile (gate): never ready,
   canary_mismatch with expected and got, after the crash-loop count the fallback profile,
   which serves the real weights and matches (the third launch that matches);
6. a reload with policy alert (back to the primary, perturbed): ready, the mismatch reported in
   /status, the metrics and the status line; the server itself answers 16 tokens of another
   greedy text than step 2's, the same one twice, and the hook logged its noise.

Steps 2, 4 and 6 prove the test-only fault hooks (tests/realsglang/faulthook) on this module's
own launches; tests/realsglang/test_real_quality_rig.py keeps the canary model's build check.

The figures for docs/benchmarks.md are printed with -s ([realsglang] lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from supervisor.quality import compare
from supervisor.quality.asking import ask
from supervisor.quality.golden import CanaryStore
from testkit import realsglang as real
from testkit.daemon import log_time
from testkit.realsglang import Real, daemon_config, generate, real_daemon, report
from testkit.wait import wait_until

pytestmark = pytest.mark.timeout(1500)

PERTURB = {"KIMI_TEST_FAULT": "perturbed-weights,slow-decode"}
SLOW_S = 0.2  # KIMI_TEST_SLOW_DECODE_SECONDS of every launch here
DECODE_BATCHES = real.CANARY_TOKENS - 1  # the first token comes from the prefill batch
FLOOR = DECODE_BATCHES * SLOW_S  # what the hook's sleeps alone add to one 16-token answer


@pytest.fixture(scope="module")
def served(canary_sgl: real.SGLangEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    tmp = tmp_path_factory.mktemp("quality")
    slow = tmp / "slow-decode"
    cfg = daemon_config(
        tmp,
        canary_sgl,
        env={
            # Harmless until the file exists (tests/realsglang/faulthook).
            "KIMI_TEST_FAULT": "slow-decode",
            "KIMI_TEST_SLOW_DECODE_FILE": str(slow),
            "KIMI_TEST_SLOW_DECODE_SECONDS": f"{SLOW_S:g}",
        },
        quality={
            "canary": {
                "prompt": real.CANARY_PROMPT,
                "max_tokens": real.CANARY_TOKENS,
                "interval": "2s",
            }
        },
        # The fallback profile drops the weight perturbation (step 4).
        profiles={"fallback": {"env": {"KIMI_TEST_FAULT": "slow-decode"}}},
        restart={"fallback_profile": "fallback"},
        # Six launches share two cores with other work: a slow one must not time out.
        readiness={"load_timeout": "900s"},
    )
    with real_daemon(tmp, cfg) as r:
        yield r


@pytest.fixture(scope="module")
def reference(served: Real) -> dict[str, Any]:
    """The unperturbed server's greedy answer to the canary prompt, with its logprobs: taken
    once, from the first primary launch that is ready when a test first asks (launch 2 in file
    order; launch 1 when a later test runs alone)."""
    real_until(lambda: _ready(served), 900, "ready")
    with httpx.Client(trust_env=False) as client:
        return real.greedy_answer(client, served.sglang_url)


def quality(r: Real) -> dict[str, Any]:
    q: dict[str, Any] = r.d.status()["quality"]
    return q


def journal_match(r: Real, pattern: str, since: int = 0) -> re.Match[str] | None:
    """The first of the daemon's output lines from index `since` on (SGLang's own lines are
    forwarded as they come) that matches `pattern`."""
    rx = re.compile(pattern)
    for line in r.d.raw[since:]:
        if m := rx.search(line):
            return m
    return None


def wait_journal(r: Real, pattern: str, timeout: float, since: int = 0) -> re.Match[str]:
    wait_until(lambda: journal_match(r, pattern, since) is not None, timeout, repr(pattern))
    found = journal_match(r, pattern, since)
    assert found is not None
    return found


def timed(client: httpx.Client, url: str) -> tuple[float, dict[str, Any]]:
    t0 = time.monotonic()
    got = real.greedy_answer(client, url)
    return time.monotonic() - t0, got


def fastest(client: httpx.Client, url: str, reference: dict[str, Any]) -> float:
    """Seconds of the fastest of three greedy answers straight from the server, each the
    reference text. Three, because the daemon's own probe (every second) and canary (every
    2 s) share the server's decode batches with them on two shared cores."""
    took = []
    for _ in range(3):
        seconds, got = timed(client, url)
        assert got["ids"] == reference["ids"], (got["text"], reference["text"])
        took.append(seconds)
    return min(took)


def test_golden_learned_on_the_first_launch_and_matched_on_the_next(served: Real) -> None:
    served.wait_ready(900)
    q = quality(served)
    assert q["canary"]["state"] == "learned", q
    assert q["canary"]["checked_tokens"] == real.CANARY_TOKENS
    golden = q["canary"]["got"]
    store = CanaryStore(str(served.tmp / "state" / "canary"))
    assert [g.answer.text for g in store.goldens()] == [golden]
    report("canary cost at readiness (launch 1)", q["canary"]["ms"], "ms")
    assert served.d.post("/restart").status_code == 202
    served.d.wait_state("restarting")
    served.wait_ready(900)
    q = quality(served)
    assert q["canary"]["state"] == "matched", q
    assert q["canary"]["expected"] == q["canary"]["got"] == golden
    report("canary cost at readiness (launch 2)", q["canary"]["ms"], "ms")


def test_canary_model_is_confident(reference: dict[str, Any]) -> None:
    assert len(reference["ids"]) == real.CANARY_TOKENS
    # Several nats at every position (the random tiny model: hundredths); 1 nat is far below.
    assert min(reference["margins"]) > 1.0, reference


def _load(url: str, stop: threading.Event, i: int) -> None:
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            generate(url, 48, text=f"Story {i}: once upon a time", timeout=120)


def test_no_false_alarm_over_a_hundred_canaries(served: Real) -> None:
    store = CanaryStore(str(served.tmp / "state" / "canary"))
    (golden,) = store.goldens()
    url = served.sglang_url
    results: dict[str, list[bool]] = {"idle": [], "radix": [], "load": []}
    costs: list[float] = []
    runs_before = quality(served)["canary"]["runs"]

    async def run() -> None:
        async with httpx.AsyncClient() as http:
            for phase in results:
                stop = threading.Event()
                threads = (
                    [threading.Thread(target=_load, args=(url, stop, i)) for i in range(3)]
                    if phase == "load"
                    else []
                )
                for t in threads:
                    t.start()
                try:
                    for _ in range(35):
                        if phase == "radix":
                            generate(url, real.CANARY_TOKENS, text=real.CANARY_PROMPT)
                        got, took = await ask(
                            http, url, real.CANARY_PROMPT, real.CANARY_TOKENS, 120.0
                        )
                        assert not isinstance(got, str), got
                        if phase == "radix":
                            assert got.cached_tokens, "the canary's prompt was not a cache hit"
                        results[phase].append(compare(golden.answer, got).match)
                        if phase == "idle":
                            costs.append(took * 1000)
                finally:
                    stop.set()
                    for t in threads:
                        t.join()

    asyncio.run(run())
    total = sum(len(v) for v in results.values())
    alarms = sum(not m for v in results.values() for m in v)
    q = quality(served)
    daemon_runs = q["canary"]["runs"] - runs_before
    report("canaries compared", total + daemon_runs, "canaries")
    report("false alarms", alarms + q["canary"]["mismatches"], "canaries")
    report("canary cost at idle, median", statistics.median(costs), "ms")
    assert total >= 100 and alarms == 0, results
    # The daemon's own canaries ran meanwhile (interval 2 s) and matched too.
    assert daemon_runs >= 1
    assert q["canary"]["mismatches"] == 0 and q["canary"]["state"] == "matched"
    assert q["degraded"] == []
    assert served.d.status()["restarts"].get("canary_mismatch", 0) == 0


def test_slowed_decode_is_reported_without_a_restart(
    served: Real, reference: dict[str, Any]
) -> None:
    real_until(lambda: _ready(served), 900, "ready")  # also when run alone (-k)
    launch = served.d.status()["child"]["launch"]
    # The launch's own baseline exists (its first probes at full speed).
    real_until(lambda: quality(served)["decode_reference"] is not None, 60, "a speed baseline")
    sleeping = rf"kimi-test-fault: slow-decode: sleeping {SLOW_S:g} s"
    slow = served.tmp / "slow-decode"
    with httpx.Client(trust_env=False) as client:
        # The hook is armed on every launch here, but sleeps only while the file exists.
        fast = fastest(client, served.sglang_url, reference)
        assert fast < FLOOR, f"{fast:.2f} s before the trigger: not fast"
        assert journal_match(served, "slow-decode: sleeping") is None
        t0 = time.time()
        slow.touch()
        try:
            ev = served.d.wait_for(
                lambda e: e.get("event") == "quality degraded" and e.get("reason") == "slow_decode",
                180,
                what="slow_decode",
            )
            report("slowed decode -> slow_decode", log_time(ev) - t0)
            st = served.d.status()
            assert "slow_decode" in st["quality"]["degraded"]
            assert st["state"] == "ready" and st["child"]["launch"] == launch
            assert "quality: slow_decode" in st["status_line"]
            # Only then a request of the test's own (beside the daemon's probes it would be
            # one more request in their batches while the daemon judges their speed).
            wait_journal(served, sleeping, 10)
            slowed, got = timed(client, served.sglang_url)
            assert slowed >= FLOOR, f"{slowed:.2f} s with the trigger: not slowed"
            assert got["ids"] == reference["ids"]  # slower, not different
        finally:
            slow.unlink()
        real_until(lambda: "slow_decode" not in quality(served)["degraded"], 180, "recovery")
        fast_again = fastest(client, served.sglang_url, reference)
        assert fast_again < FLOOR, f"{fast_again:.2f} s after the trigger went: still slow"
    assert served.d.status()["child"]["launch"] == launch  # the same server throughout
    print(
        f"\n[realsglang] slow-decode, 16 tokens: fast {fast:.2f} s, slowed {slowed:.2f} s,"
        f" fast again {fast_again:.2f} s"
    )


def _ready(r: Real) -> bool:
    try:
        return r.readyz() == 200
    except httpx.HTTPError:
        return False  # the admin endpoint is not up yet


def real_until(pred: Any, timeout: float, what: str) -> None:
    wait_until(pred, timeout, what, interval=0.5)  # a real server: no need to ask more often


def test_perturbed_weights_gate_then_fallback(served: Real) -> None:
    golden = quality(served)["canary"]["expected"]
    served.rewrite(
        lambda c: (
            c["sglang"]["env"].update(PERTURB),
            c["restart"]["crash_loop"].update({"max_restarts": 2}),
        )
    )
    served.d.signal(signal.SIGHUP)
    # The reload checks the new command line with SGLang's own parser first (over 30 s at a
    # load average of 10 on the two cores).
    assert served.d.wait_state("restarting", 240)["reason"] == "reload"
    port_open = served.d.wait_state("warming", 900)
    mismatch = served.d.wait_for(
        lambda e: e.get("event") == "state" and e.get("reason") == "canary_mismatch",
        900,
        what="canary_mismatch",
    )
    report(
        "perturbed launch: port open -> canary_mismatch", log_time(mismatch) - log_time(port_open)
    )
    assert f"expected {golden!r}, got " in mismatch["detail"]
    served.d.wait_for(lambda e: e.get("event") == "profile changed", 1200, what="the fallback")
    ready = served.wait_ready(900)
    st = served.d.status()
    assert st["profile"] == "fallback"
    assert st["restarts"]["canary_mismatch"] == 2
    assert st["quality"]["canary"]["state"] == "matched"
    # Nothing said ready between the reload and the fallback's launch.
    states = [e for e in served.d.seen if e.get("event") == "state"]
    since = max(i for i, e in enumerate(states) if e.get("reason") == "reload")
    assert [e["new"] for e in states[since:]].count("ready") == 1
    assert ready["reason"] == "probe_ok"
    assert st["last_restart"]["incident"]


def test_perturbed_weights_alert_serves_and_reports(
    served: Real, reference: dict[str, Any]
) -> None:
    since = len(served.d.raw)
    served.rewrite(lambda c: c["quality"]["canary"].update({"policy": "alert"}))
    served.d.signal(signal.SIGHUP)
    # The reload checks the new command line with SGLang's own parser first (over 30 s at a
    # load average of 10 on the two cores).
    assert served.d.wait_state("restarting", 240)["reason"] == "reload"
    served.wait_ready(900)
    st = served.d.status()
    assert st["profile"] == "primary"
    q = st["quality"]
    assert q["canary"]["state"] == "mismatch", q
    assert q["canary"]["expected"] != q["canary"]["got"]
    assert q["degraded"] == ["canary_mismatch"]
    metrics = served.d.get("/metrics").text
    assert "kimi_serve_canary_ok 0.0" in metrics
    assert 'kimi_serve_quality_degraded{reason="canary_mismatch"} 1.0' in metrics
    assert "quality: canary_mismatch" in st["status_line"]
    # The served text itself: 16 tokens, as asked, of another greedy text, and consistently so.
    with httpx.Client(trust_env=False) as client:
        got = real.greedy_answer(client, served.sglang_url)
        again = real.greedy_answer(client, served.sglang_url)
    hook = wait_journal(
        served, r"kimi-test-fault: perturbed-weights: noise 1 x std on (\d+)", 10, since
    )
    assert int(hook.group(1)) > 0
    assert len(got["ids"]) == real.CANARY_TOKENS
    assert got["ids"] != reference["ids"], (got["text"], reference["text"])
    assert again["ids"] == got["ids"]
