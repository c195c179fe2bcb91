"""The serving-quality rig on the real SGLang 0.5.23 server: the canary model and the fault hooks.

- tools/make-canary-model gives the same bytes twice (one more build beside the cached one);
- one server of the canary model with KIMI_TEST_FAULT=slow-decode armed by a file: fast, then
  slow while the file exists (every decode batch sleeps), then fast again, with the same
  greedy text throughout and no restart;
- one server with KIMI_TEST_FAULT=perturbed-weights: it decodes, 16 tokens as asked, but a
  different greedy text from the first server's.

Two launches in all (docs/realsglang.md, "The canary model" and "The fault hook").
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit import realsglang as real

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SLOW_S = 0.5  # per decode batch: 15 decode batches of a 16-token answer sleep >= 7.5 s
START_TIMEOUT = 400.0  # launches took over 180 s with other jobs on the two cores
DECODE_BATCHES = real.CANARY_TOKENS - 1  # the first token comes from the prefill batch


def timed(client: httpx.Client, url: str) -> tuple[float, dict[str, Any]]:
    t0 = time.monotonic()
    got = real.greedy_answer(client, url)
    return time.monotonic() - t0, got


def test_canary_model_is_deterministic(canary_sgl: real.SGLangEnv, tmp_path: Path) -> None:
    cached = Path(canary_sgl.model)
    again = tmp_path / "canary-model"
    subprocess.run(
        [canary_sgl.python, str(real.CANARY_MAKER), "--rebuild", str(again)],
        check=True,
        capture_output=True,
        timeout=real.BUILD_TIMEOUT,
    )
    sums = (again / "SHA256SUMS").read_text()
    assert "model.safetensors" in sums and "tokenizer.json" in sums
    assert sums == (cached / "SHA256SUMS").read_text()
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=again, check=True)


@pytest.fixture(scope="module")
def slow_server(
    canary_sgl: real.SGLangEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[real.RealServer, Path]]:
    tmp = tmp_path_factory.mktemp("slow")
    trigger = tmp / "slow-now"
    env = real.slow_decode_env(SLOW_S, file=trigger)
    with real.running(canary_sgl, tmp / "sglang.log", env=env, timeout=START_TIMEOUT) as srv:
        yield srv, trigger


@pytest.fixture(scope="module")
def reference(slow_server: tuple[real.RealServer, Path]) -> dict[str, Any]:
    srv, _ = slow_server
    with httpx.Client(trust_env=False) as client:
        return real.greedy_answer(client, srv.url)


def test_canary_model_is_confident(reference: dict[str, Any]) -> None:
    assert len(reference["ids"]) == real.CANARY_TOKENS
    # Several nats at every position (the random tiny model: hundredths); 1 nat is far below.
    assert min(reference["margins"]) > 1.0, reference


def test_slow_decode_slows_a_running_server(
    slow_server: tuple[real.RealServer, Path], reference: dict[str, Any]
) -> None:
    srv, trigger = slow_server
    floor = DECODE_BATCHES * SLOW_S  # what the sleeps alone add to one answer
    with httpx.Client(trust_env=False) as client:
        fast, got = timed(client, srv.url)
        assert got["ids"] == reference["ids"]
        assert fast < floor, f"{fast:.2f} s before the trigger: not fast"
        assert "slow-decode: sleeping" not in srv.log()

        trigger.touch()
        slow, got = timed(client, srv.url)
        assert slow >= floor, f"{slow:.2f} s with the trigger: not slowed"
        assert got["ids"] == reference["ids"]  # slower, not different
        srv.wait_log(rf"kimi-test-fault: slow-decode: sleeping {SLOW_S:g} s", 10)

        trigger.unlink()
        fast_again, got = timed(client, srv.url)
        assert fast_again < floor, f"{fast_again:.2f} s after the trigger went: still slow"
        assert got["ids"] == reference["ids"]
    assert srv.proc.poll() is None  # the same server throughout
    real_report = f"fast {fast:.2f} s, slowed {slow:.2f} s, fast again {fast_again:.2f} s"
    print(f"\n[realsglang] slow-decode, 16 tokens: {real_report}")


def test_perturbed_weights_change_the_greedy_text(
    slow_server: tuple[real.RealServer, Path],
    reference: dict[str, Any],
    canary_sgl: real.SGLangEnv,
    tmp_path: Path,
) -> None:
    slow_server[0].stop()  # one real server at a time on two cores
    log = tmp_path / "sglang.log"
    env = real.perturbed_env()
    with (
        real.running(canary_sgl, log, env=env, timeout=START_TIMEOUT) as srv,
        httpx.Client(trust_env=False) as client,
    ):
        got = real.greedy_answer(client, srv.url)
        again = real.greedy_answer(client, srv.url)
        hook = srv.wait_log(r"kimi-test-fault: perturbed-weights: noise 1 x std on (\d+)", 10)
    assert int(hook.group(1)) > 0
    assert len(got["ids"]) == real.CANARY_TOKENS  # it decodes, as asked
    assert got["ids"] != reference["ids"], (got["text"], reference["text"])
    assert again["ids"] == got["ids"]  # wrong, and consistently so
