"""A client loop for hand-over tests and the benchmark: /readyz on a new connection every time
(as a load balancer's health check) and a numbered request to SGLang, each answer counted, so
a refused connection, a non-200 and a log line lost or doubled across an exec all show.

`access_lines(d)`: how often each numbered request appears in SGLang's log as the daemon
forwarded it (the access line real SGLang's uvicorn and the stand-in both print).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from testkit.daemon import DaemonProcess

NUMBERED = re.compile(r"/get_model_info\?n=(\d+) ")


def access_lines(d: DaemonProcess) -> Counter[int]:
    """How often each of the client's numbered requests appears in SGLang's forwarded log."""
    seen: Counter[int] = Counter()
    for raw in d.raw:
        with contextlib.suppress(ValueError):
            e = json.loads(raw)
            m = NUMBERED.search(str(e.get("event"))) if e.get("source") == "sglang" else None
            if m:
                seen[int(m.group(1))] += 1
    return seen


class Hammer:
    """A client loop on /readyz (the admin port) and on SGLang itself, counting every answer."""

    def __init__(self, admin: str, sglang: str, key: str | None = None) -> None:
        self.admin, self.sglang = admin, sglang
        # A keyed SGLang (sglang.api_key_file) answers only requests that carry its key.
        self.sglang_headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        self.codes: Counter[str] = Counter()
        self.sent = 0
        self.failed = 0  # requests to SGLang that did not answer 200
        self.slowest_s = 0.0  # the slowest /readyz answer
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        # A new connection for every /readyz, as a load balancer's health check makes: the
        # one that would meet a closed port, were the socket not inherited.
        close = {"Connection": "close"}
        # A generous timeout: on a loaded host the new daemon may take seconds to start, and a
        # slow answer is not a failed one (the latency is measured: `slowest_s`).
        with httpx.Client(timeout=60.0) as c:
            while not self.done.is_set():
                began = time.monotonic()
                try:
                    answer = c.get(f"{self.admin}/readyz", headers=close)
                    self.codes[str(answer.status_code)] += 1
                except httpx.HTTPError as exc:
                    self.codes[type(exc).__name__] += 1
                self.slowest_s = max(self.slowest_s, time.monotonic() - began)
                self.sent += 1
                try:
                    info = f"{self.sglang}/get_model_info?n={self.sent}"
                    ok = c.get(info, headers=self.sglang_headers).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.failed += not ok

    def __enter__(self) -> Hammer:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.thread.join(10)


def liveness(d: DaemonProcess) -> tuple[float, float]:
    """(liveness probes passed, liveness probes failed) in the daemon's /metrics. After a
    hand-over the passed count is the new program's own (a histogram, not carried), the
    failures go on from the old program's (a counter, carried)."""
    passed = failed = 0.0
    for family in text_string_to_metric_families(d.get("/metrics").text):
        for sample in family.samples:
            if sample.labels.get("kind") != "liveness":
                continue
            ok = sample.labels.get("outcome") == "ok"
            if sample.name == "kimi_serve_probe_duration_seconds_count" and ok:
                passed += sample.value
            elif sample.name == "kimi_serve_probe_failures_total":
                failed += sample.value
    return passed, failed
