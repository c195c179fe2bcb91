"""A fleet for tests: replicas run by the real `kimi-serve run` (stand-in SGLang) behind a real
router (sglang-router or SMG), and what reached each replica.

Each replica's stand-in appends a line per `/generate` request *on arrival* to its request log
(STANDIN_REQUEST_LOG): the load generator's prompts start with "Request ", kimi-serve's probes
do not, so user requests are told apart from probes, hung requests included.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from testkit.daemon import DaemonProcess, base_config, running
from testkit.router import routed

USER_PROMPT = "Request "  # bench.loadgen's prompts


def event_time(ev: Mapping[str, Any]) -> float:
    """The wall-clock time of a daemon log event (structlog's ISO timestamp)."""
    return datetime.fromisoformat(str(ev["timestamp"]).replace("Z", "+00:00")).timestamp()


def replica_config(
    tmp: Path, router_url: str, env: Mapping[str, str] | None = None, **overrides: Any
) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    sglang_env = {
        "STANDIN_REQUEST_LOG": str(tmp / "requests.jsonl"),
        # 16 tokens take 0.3 s: streams are in flight when a replica is taken out.
        "STANDIN_DECODE_SECONDS_PER_TOKEN": "0.02",
        "STANDIN_CRASH_SLEEP_SECONDS": "1",
        **(env or {}),
    }
    return base_config(
        tmp,
        sglang={"env": sglang_env},
        router={"url": router_url, "drain_timeout": "5s"},
        liveness={"interval": "1s", "timeout": "1s", "failure_threshold": 2},
        stop={"drain_timeout": "10s"},
        **overrides,
    )


def user_arrivals(cfg: Mapping[str, Any]) -> list[float]:
    """Arrival times of the load generator's requests at this replica's SGLang."""
    path = Path(cfg["sglang"]["env"]["STANDIN_REQUEST_LOG"])
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if str(doc.get("text") or "").startswith(USER_PROMPT):
                out.append(float(doc["t"]))
    return out


def worker_url(cfg: Mapping[str, Any]) -> str:
    return f"http://127.0.0.1:{cfg['sglang']['port']}"


@contextlib.contextmanager
def replicas(*cfgs: tuple[Path, dict[str, Any]]) -> Iterator[list[DaemonProcess]]:
    """Start every replica at once (their stand-ins load in parallel); stop them all at exit."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(running(tmp, cfg)) for tmp, cfg in cfgs]


def registered(d: DaemonProcess) -> bool:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        return bool((d.status().get("router") or {}).get("registered"))
    return False


class ListWatch:
    """Polls the router's worker list in a thread: when each URL was (last) seen listed (as one
    it routes to: SMG's `pending` and `draining` entries do not count)."""

    def __init__(self, router_url: str, interval: float = 0.05) -> None:
        self.url = router_url.rstrip("/") + "/workers"
        self.interval = interval
        self.history: list[tuple[float, frozenset[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ListWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        with httpx.Client(trust_env=False, timeout=2) as c:
            while not self._stop.is_set():
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    doc = c.get(self.url).json()
                    urls = frozenset(
                        w["url"].rstrip("/") for w in doc.get("workers", []) if routed(w)
                    )
                    self.history.append((time.time(), urls))
                self._stop.wait(self.interval)

    def listed(self, url: str) -> bool:
        return bool(self.history) and url.rstrip("/") in self.history[-1][1]

    def first_unlisted_after(self, url: str, since: float) -> float | None:
        """The first poll at or after `since` that did not list `url`."""
        for at, urls in self.history:
            if at >= since and url.rstrip("/") not in urls:
                return at
        return None

    def first_listed_after(self, url: str, since: float) -> float | None:
        """The first poll at or after `since` that listed `url`."""
        for at, urls in self.history:
            if at >= since and url.rstrip("/") in urls:
                return at
        return None

    def last_listed(self, url: str) -> float | None:
        seen = [at for at, urls in self.history if url.rstrip("/") in urls]
        return seen[-1] if seen else None
