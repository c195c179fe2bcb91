"""The second round of hostile neighbours, each run as the attack was: the real daemon, a real
SGLang stand-in that turns hostile (a module that patches it, the way test_worker_helper_exit
does), real sockets; `/livez` polled throughout from another thread, the daemon's RSS sampled.

- a log line that made redaction's regex backtrack (`'api_key': '` + 40 backslashes): /livez
  stalled for about 24 s a line;
- a `/server_info` nested 700 deep (under json's own limit): RecursionError in the recursive
  redaction of the intent check's record, SGLang stopped and the daemon exited 1;
- a gzip bomb on `/metrics` (read uncapped, gzip accepted): GBs of RSS at each probe;
- a 1 EiB sparse weight file, a link to it and a FIFO in the model directory under
  `warm.prewarm: auto`: MemoryError in the residency map, then the same stop;
- the restart's detail (a traceback) in systemd's STATUS=, which any local user reads.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from testkit import base_config, running
from testkit.cli import kimi_serve
from testkit.daemon import DaemonProcess, reaped
from testkit.notify import NotifyListener

pytestmark = pytest.mark.timeout(120)

# What each attack may cost at most, after the fixes (docs/security.md has the figures).
LIVEZ_P99_S = 1.0
RSS_GROWTH_MAX = 150 << 20

HOSTILE = r"""
import gzip, os, runpy, sys, threading, time
from aiohttp import web
from supervisor.standin import api

mode = os.environ["HOSTILE"]
if mode == "deep-info":
    DEEP = ('{"a":' * 700 + "1" + "}" * 700).encode()

    async def server_info(self, request):
        return web.Response(body=DEEP, content_type="application/json")

    api.Api.server_info = server_info
elif mode == "gzip-metrics":
    BOMB = gzip.compress(b"\n" * (int(os.environ["HOSTILE_BOMB_MIB"]) << 20), 9)

    async def metrics(self, request):
        headers = {"Content-Type": "text/plain; version=0.0.4", "Content-Encoding": "gzip"}
        return web.Response(body=BOMB, headers=headers)

    api.Api.metrics = metrics
elif mode == "backslash-line":
    LINE = "server_args=ServerArgs({'api_key': '" + "\\" * int(os.environ["HOSTILE_BACKSLASHES"])

    def lines():
        while True:
            time.sleep(0.2)
            print(LINE, file=sys.stderr, flush=True)

    threading.Thread(target=lines, daemon=True).start()
sys.argv[0] = "supervisor.standin"
runpy.run_module("supervisor.standin", run_name="__main__", alter_sys=True)
"""


def hostile_config(tmp: Path, mode: str, **env: str) -> dict[str, Any]:
    mods = tmp / "mods"
    mods.mkdir(exist_ok=True)
    (mods / "hostile_sglang.py").write_text(HOSTILE)
    return base_config(
        tmp,
        sglang={
            "module": "hostile_sglang",
            "env": {
                "PYTHONPATH": os.pathsep.join([str(mods), *sys.path[1:]]),
                "HOSTILE": mode,
                **env,
            },
        },
    )


class Watch:
    """/livez polled every 50 ms and the daemon's RSS sampled, from a thread, until stopped."""

    def __init__(self, d: DaemonProcess) -> None:
        self.url = d.admin + "/livez"
        self.proc = psutil.Process(d.proc.pid)
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.rss: list[int] = [self.proc.memory_info().rss]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    r = client.get(self.url)
                    if r.status_code != 200:
                        self.failures.append(f"HTTP {r.status_code}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self.latencies.append(time.monotonic() - start)
                self.rss.append(self.proc.memory_info().rss)
                self._stop.wait(0.05)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(15)

    @property
    def p99(self) -> float:
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[98]

    def report(self, what: str) -> str:
        grow = (max(self.rss) - self.rss[0]) / 2**20
        return (
            f"{what}: /livez p99 {self.p99 * 1000:.0f} ms, max {max(self.latencies) * 1000:.0f} ms"
            f" over {len(self.latencies)} probes, {len(self.failures)} failed; daemon RSS"
            f" {self.rss[0] / 2**20:.0f} MiB, peak {max(self.rss) / 2**20:.0f} MiB (+{grow:.0f})"
        )


def _watched(d: DaemonProcess, seconds: float, what: str) -> Watch:
    with Watch(d) as w:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert d.proc.poll() is None, "".join(d.raw[-20:])
            time.sleep(0.1)
    print(w.report(what))
    return w


def _still_serving(d: DaemonProcess, pid: int) -> None:
    assert d.proc.poll() is None, "".join(d.raw[-20:])
    doc = d.status()
    assert doc["state"] == "ready", doc["state"]
    assert doc["child"]["pid"] == pid and doc["restarts"] == {}, doc["restarts"]
    lines = "".join(d.raw)
    assert "internal task failed" not in lines and "Traceback" not in lines


def _attacked(tmp_path: Path, mode: str, what: str, **env: str) -> tuple[DaemonProcess, Watch]:
    """The daemon over the hostile stand-in, ready, then watched for 6 s of the attack; still
    serving the same SGLang, unrestarted, afterwards."""
    with running(tmp_path, hostile_config(tmp_path, mode, **env)) as d:
        d.wait_state("ready", timeout=60)
        pid = d.sglang_pid()
        w = _watched(d, 6.0, what)
        assert not w.failures and w.p99 < LIVEZ_P99_S, w.report(what)
        _still_serving(d, pid)
    return d, w


def test_a_backtracking_log_line_never_stalls_the_loop(tmp_path: Path) -> None:
    d, _ = _attacked(tmp_path, "backslash-line", "backslash line", HOSTILE_BACKSLASHES="40")
    # The lines did arrive, forwarded redacted.
    assert any("'api_key': '<redacted>" in line for line in d.raw), d.raw[-5:]


def test_a_deep_server_info_is_no_answer_and_stops_nothing(tmp_path: Path) -> None:
    # The intent check reads /server_info after the first successful probe, the quality watch
    # once more; both are past when a few liveness probes have been answered.
    _attacked(tmp_path, "deep-info", "deep /server_info")


def test_a_gzip_bomb_on_metrics_is_not_inflated(tmp_path: Path) -> None:
    what = "gzip bomb on /metrics (512 MiB inflated)"
    _, w = _attacked(tmp_path, "gzip-metrics", what, HOSTILE_BOMB_MIB="512")
    assert max(w.rss) - w.rss[0] < RSS_GROWTH_MAX, w.report(what)


@pytest.fixture
def exbibyte(tmp_path: Path) -> Iterator[Path]:
    """A 1 EiB sparse file (tmpfs allows one; ext4 stops at 16 TiB), removed afterwards."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("needs /dev/shm (tmpfs) for a 1 EiB sparse file")
    path = shm / f"kimi-serve-test-{os.getpid()}-sparse.safetensors"
    with path.open("wb") as f:
        try:
            f.truncate(1 << 60)
        except OSError as exc:
            pytest.skip(f"cannot make a 1 EiB sparse file on /dev/shm: {exc}")
    try:
        yield path
    finally:
        path.unlink()


def test_prewarm_over_a_sparse_exbibyte_a_link_to_it_and_a_fifo(
    tmp_path: Path, exbibyte: Path
) -> None:
    cfg = base_config(tmp_path, warm={"prewarm": "auto"})
    model = Path(cfg["sglang"]["model_path"])
    (model / "model-00001-of-00003.safetensors").symlink_to(exbibyte)
    (model / "model-00002-of-00003.safetensors").symlink_to("model-00001-of-00003.safetensors")
    os.mkfifo(model / "model-00003-of-00003.safetensors")
    with running(tmp_path, cfg) as d:
        # The plan's log line (files, total, to_read), before or after ready: the readers go
        # on beside the load, so the two come in either order.
        plan = d.wait_for(lambda e: e.get("event") == "prewarm", timeout=60)
        if not any(e.get("event") == "state" and e.get("new") == "ready" for e in d.seen):
            d.wait_state("ready", timeout=60)
        pid = d.sglang_pid()
        w = _watched(d, 2.0, "prewarm over a 1 EiB sparse file")
        assert not w.failures, w.failures[:3]
        _still_serving(d, pid)
        # The FIFO is no weight file; both links name the same sparse file, which holds no
        # data: nothing to read, and nothing sized by its claimed exbibyte.
        assert plan["files"] == 2 and plan["total"] == 2 << 60, plan
        assert plan["to_read"] == 0, plan


def test_status_for_systemd_carries_no_restart_detail(tmp_path: Path) -> None:
    """STATUS= is for every local user (`systemctl status`): the reason, never the traceback
    that the unauthenticated /status withholds."""
    cfg = base_config(
        tmp_path,
        sglang={"env": {"STANDIN_FAULT": "seed-incident", "STANDIN_FAULT_LAUNCH": "1"}},
    )
    listener = NotifyListener()
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "NOTIFY_SOCKET": listener.address}
    try:
        with reaped(DaemonProcess.start(path, cfg, env)) as d:
            ev = d.wait_for(lambda e: e.get("new") == "restarting", timeout=60)
            assert "EAGLEWorkerV2" in ev["detail"], ev  # the text exists, for the token holder
            d.wait_state("ready", timeout=60)  # the second launch, without the fault
        statuses = [m for _, m in listener.messages if "STATUS=" in m]
        assert any("restarting" in m for m in statuses), statuses
        leaked = [m for m in statuses if "EAGLEWorkerV2" in m or "AttributeError" in m]
        assert not leaked, leaked
    finally:
        listener.close()


# Billion laughs: a 1 KB file whose `logging.format` names nine of nine of ... "lol" (9**8).
BOMB = "".join(f"  l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]\n" for n in range(2, 9)).join(
    ("x-laughs:\n  l1: &l1 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n", "")
)


def _bombed(cfg: dict[str, Any]) -> str:
    """The config as YAML with the bomb's anchors before it and `logging.format: *l8`."""
    doc = {k: v for k, v in cfg.items() if k != "logging"}
    return BOMB + yaml.safe_dump(doc) + "logging:\n  format: *l8\n"


def test_an_alias_bomb_is_refused_fast_by_check(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_bombed(base_config(tmp_path)))
    assert len(path.read_bytes()) < 4096
    start = time.monotonic()
    done = kimi_serve("check", "--config", str(path))  # no traceback, within 30 s
    took = time.monotonic() - start
    assert done.returncode == 78, done.stderr
    assert f"{path}:9: x-laughs.l8[0]: an alias here expands to" in done.stderr, done.stderr
    assert took < 5.0, took  # it ran past 20 s at 1.4 GB


def test_an_alias_bomb_on_sighup_is_refused_and_the_daemon_stays_responsive(
    tmp_path: Path,
) -> None:
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready", timeout=30)
        pid = d.sglang_pid()
        d.config_path.write_text(_bombed(cfg))
        with Watch(d) as w:
            d.signal(signal.SIGHUP)
            ev = d.wait_for(
                lambda e: str(e.get("event", "")).startswith("reload refused"), timeout=20
            )
            time.sleep(1.0)  # a second of probes after the refusal
        print(w.report("alias bomb on SIGHUP"))
        assert "expands to" in json.dumps(ev), ev
        assert not w.failures and w.p99 < LIVEZ_P99_S, w.report("alias bomb")
        assert max(w.rss) - w.rss[0] < RSS_GROWTH_MAX, w.report("alias bomb")
        _still_serving(d, pid)
        assert d.stop() == 0  # SIGTERM honoured; `reaped` proves SGLang is gone too
