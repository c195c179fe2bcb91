"""Serving quality against the real SGLang 0.5.23 server, serving the confident canary model
(tools/make-canary-model). One daemon for the whole module, its launches in file order:

1. launch 1 learns the golden answer; a manual restart: launch 2 matches it;
2. 100+ canaries against launch 2, at idle, right after the same prompt (a radix-cache hit)
   and under concurrent load, compared as the daemon compares: zero false alarms; the daemon's
   own canaries (every 2 s meanwhile) raise none either;
3. decode slowed (the fault hook's slow-decode, switched on by a file): slow_decode reported,
   no restart; removed: it clears;
4. a reload adds perturbed weights to the primary profile (gate): never ready,
   canary_mismatch with expected and got, after the crash-loop count the fallback profile,
   which serves the real weights and matches (the third launch that matches);
5. a reload with policy alert (back to the primary, perturbed): ready, the mismatch reported in
   /status, the metrics and the status line.

The figures for docs/benchmarks.md are printed with -s ([realsglang] lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from supervisor.daemon.quality_watch import ask
from supervisor.quality import compare
from supervisor.quality.golden import CanaryStore
from testkit import realsglang as real
from testkit.daemon import log_time
from testkit.realsglang import Real, daemon_config, generate, real_daemon, report

pytestmark = pytest.mark.timeout(1500)

PERTURB = {"KIMI_TEST_FAULT": "perturbed-weights,slow-decode"}


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
            "KIMI_TEST_SLOW_DECODE_SECONDS": "0.2",
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


def quality(r: Real) -> dict[str, Any]:
    q: dict[str, Any] = r.d.status()["quality"]
    return q


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


def test_slowed_decode_is_reported_without_a_restart(served: Real) -> None:
    real_until(lambda: _ready(served), 900, "ready")  # also when run alone (-k)
    launch = served.d.status()["child"]["launch"]
    # The launch's own baseline exists (its first probes at full speed).
    real_until(lambda: quality(served)["decode_reference"] is not None, 60, "a speed baseline")
    slow = served.tmp / "slow-decode"
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
    finally:
        slow.unlink()
    real_until(lambda: "slow_decode" not in quality(served)["degraded"], 180, "recovery")
    assert served.d.status()["child"]["launch"] == launch


def _ready(r: Real) -> bool:
    try:
        return r.readyz() == 200
    except httpx.HTTPError:
        return False  # the admin endpoint is not up yet


def real_until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_perturbed_weights_gate_then_fallback(served: Real) -> None:
    golden = quality(served)["canary"]["expected"]
    served.rewrite(
        lambda c: (
            c["sglang"]["env"].update(PERTURB),
            c["restart"]["crash_loop"].update({"max_restarts": 2}),
        )
    )
    served.d.signal(signal.SIGHUP)
    assert served.d.wait_state("restarting")["reason"] == "reload"
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


def test_perturbed_weights_alert_serves_and_reports(served: Real) -> None:
    served.rewrite(lambda c: c["quality"]["canary"].update({"policy": "alert"}))
    served.d.signal(signal.SIGHUP)
    assert served.d.wait_state("restarting")["reason"] == "reload"
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
