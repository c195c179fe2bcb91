"""A backend standing in for the daemon behind the admin endpoint (`admin.serve`), with
SGLang's text (`SGLANG_LINE`) in every place it goes, so a test sees where it leaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from supervisor import config
from supervisor.metrics import Metrics

SGLANG_LINE = "AttributeError: 'EAGLEWorkerV2' object has no attribute 'x'"


class Backend:
    """What the daemon offers the admin endpoint, with SGLang's text in every place it goes."""

    def __init__(self, tmp: Path) -> None:
        self.cfg = config.parse(
            f"sglang: {{model_path: /m}}\ngpus: {{manage: false}}\nstate_dir: {tmp}\n", "t.yaml"
        )
        self.metrics = Metrics()
        self.restarts = 0

    def status_document(self) -> dict[str, Any]:
        return {
            "state": "restarting",
            "detail": SGLANG_LINE,
            "status_line": f"restarting (primary) - {SGLANG_LINE}",
            "restarts": {"fatal_log": 1},
            "last_restart": {
                "reason": "fatal_log",
                "at": 1.0,
                "exit_code": None,
                "signal": None,
                "detail": SGLANG_LINE,
                "log_tail": ["Traceback (most recent call last):", SGLANG_LINE],
            },
            "last_probe": {
                "ok": False,
                "latency_s": 0.5,
                "reason": "http_status",
                "error": f"HTTP 500: {SGLANG_LINE}",
            },
            "gpus": [{"index": 0, "uuid": "GPU-0", "memory_used_bytes": 1, "processes": []}],
            "router": {
                "url": "http://router:30000",
                "worker_url": "http://10.0.0.1:30000",
                "registered": False,
                "worker_id": None,
                "last_error": f"register: POST /workers answered HTTP 502: {SGLANG_LINE}",
            },
            "quality": {
                "degraded": [],
                "evidence": {
                    "overlap": f"[2026-12-01 10:00:00] overlap scheduler on; {SGLANG_LINE}",
                    "decode_batches_judged": 3,
                    "graphs_expected": True,
                },
            },
            "events": [
                {
                    "at": 1.0,
                    "from": "ready",
                    "to": "restarting",
                    "reason": "fatal_log",
                    "detail": SGLANG_LINE,
                }
            ],
        }

    def is_ready(self) -> bool:
        return False

    def loop_healthy(self) -> bool:
        return True

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def request_restart(self) -> str | None:
        self.restarts += 1
        return None

    def next_launch(self) -> int:
        return self.restarts + 1
