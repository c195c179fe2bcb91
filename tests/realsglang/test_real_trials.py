"""Trials and the last known good against the real SGLang 0.5.23 server, serving the confident
canary model. One daemon for the module, its launches in file order:

1. launch 1 passes its gate and serves quality.trial_period: it becomes the last known good;
2. a reload to "another version" (a second interpreter path: the side-by-side venv of
   docs/quality.md, here a wrapper of the same venv) whose weights are perturbed (the fault
   hook): a trial, judged at its gate, never ready, rolled back; the last known good (the
   original interpreter, no perturbation) is ready within one extra load;
3. a reload to the same "new version", healthy this time: a trial that passes its gate and,
   once it served trial_period, is the new last known good.

The figures for docs/benchmarks.md are printed with -s ([realsglang] lines).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit import realsglang as real
from testkit.daemon import log_time
from testkit.realsglang import Real, daemon_config, real_daemon, report

pytestmark = pytest.mark.timeout(1500)

PERIOD = "5s"
PERTURB = {"KIMI_TEST_FAULT": "perturbed-weights"}


def _wrapper(tmp: Path, python: str) -> str:
    """Another interpreter path for the same venv: what a side-by-side venv looks like to
    the comparison (`interpreter A -> B`)."""
    path = tmp / "sglang-next" / "python"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec {python} "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def served(canary_sgl: real.SGLangEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Real]:
    tmp = tmp_path_factory.mktemp("trials")
    cfg = daemon_config(
        tmp,
        canary_sgl,
        quality={
            "canary": {"prompt": real.CANARY_PROMPT, "max_tokens": real.CANARY_TOKENS},
            "trial_period": PERIOD,
            # Two shared cores: single-stream speed at the gate varies by more than the
            # production ratio between two idle launches of the same server (docs/benchmarks.md).
            "trial_slowdown": 0.5,
        },
        readiness={"load_timeout": "900s"},
    )
    with real_daemon(tmp, cfg) as r:
        yield r


def _lkg_event(r: Real, timeout: float = 300) -> dict[str, Any]:
    return r.d.wait_for(lambda e: e.get("event") == "last known good", timeout, "an LKG")


def _environ(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")


def test_the_first_launch_becomes_the_last_known_good(served: Real) -> None:
    served.wait_ready(900)
    lkg = _lkg_event(served)
    assert lkg["launch"] == 1 and lkg["sglang_version"] == "0.5.23"
    up = served.d.status()["upgrade"]
    assert up["state"] == "accepted" and up["lkg"]["rollback_possible"] is True
    report("LKG gate decode", float(lkg["tps"] or 0.0), "tokens/s")


def test_a_regressed_new_version_is_rolled_back(served: Real, canary_sgl: real.SGLangEnv) -> None:
    wrapper = _wrapper(served.tmp, canary_sgl.python)

    def next_version(c: dict[str, Any]) -> None:
        c["sglang"]["python"] = wrapper
        c["sglang"]["env"].update(PERTURB)

    served.rewrite(next_version)
    served.d.signal(signal.SIGHUP)
    reload = served.d.wait_state("restarting", 240)
    assert reload["reason"] == "reload"
    compared = served.d.wait_for(
        lambda e: e.get("event") == "compared with the last known good", 300, "the comparison"
    )
    assert compared["trial"] is True and "interpreter" in compared["differs"]
    assert compared["rollback_refused"] is None
    regressed = served.d.wait_reason("trial_regressed", 900, new="restarting")
    assert regressed["detail"].startswith("canary")
    ready = served.d.wait_state("ready", 900)
    states = [e for e in served.d.seen if e.get("event") == "state"]
    since = states.index(reload)
    between = [e["new"] for e in states[since:-1]]
    assert "ready" not in between, "the trial was never ready"
    assert between.count("launching") == 2, "one extra load: the last known good"

    up = served.d.status()["upgrade"]
    assert up["state"] == "rolled_back" and up["serving_lkg"] is True
    assert up["lkg"]["python"] == canary_sgl.python, "the last known good's interpreter"
    assert "perturbed-weights" not in _environ(served.d.sglang_pid())
    metrics = served.d.get("/metrics").text
    assert 'kimi_serve_rollbacks_total{regression="canary"} 1.0' in metrics
    report("trial comparison", float(compared["seconds"]))
    report("reload -> trial rolled back", log_time(regressed) - log_time(reload))
    report("rolled back -> ready on the LKG", log_time(ready) - log_time(regressed))


def test_a_healthy_new_version_becomes_the_last_known_good(
    served: Real, canary_sgl: real.SGLangEnv
) -> None:
    wrapper = _wrapper(served.tmp, canary_sgl.python)

    def healthy(c: dict[str, Any]) -> None:
        c["sglang"]["python"] = wrapper
        c["sglang"]["env"].pop("KIMI_TEST_FAULT", None)

    served.rewrite(healthy)
    served.d.signal(signal.SIGHUP)
    assert served.d.wait_state("restarting", 240)["reason"] == "reload"
    compared = served.d.wait_for(
        lambda e: e.get("event") == "compared with the last known good", 300, "the comparison"
    )
    assert compared["trial"] is True
    served.d.wait_state("ready", 900)
    assert "perturbed-weights" not in _environ(served.d.sglang_pid())
    lkg = _lkg_event(served)
    up = served.d.status()["upgrade"]
    assert up["state"] == "accepted" and up["lkg"]["python"] == wrapper
    assert up["lkg"]["launch"] == lkg["launch"]
    report("trial gate decode", float(lkg["tps"] or 0.0), "tokens/s")
