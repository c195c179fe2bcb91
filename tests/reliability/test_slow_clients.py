"""The slow-client attack at full strength against the real daemon: more trickling
connections than the admin endpoint has slots, each sending one header byte every 0.3 s and
opened again at once when cut. Meanwhile /livez, /readyz and /metrics, each on a fresh
loopback connection, must all be answered (they used to get 503: "too many connections"),
and SGLang is not restarted. The latency figures are bench/slow_clients.py's
(docs/benchmarks.md); here only "answered, 200".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit import base_config, running
from testkit.slowclients import Prober, TrickleProcess

pytestmark = pytest.mark.timeout(120)

CLIENTS = 100  # > max_connections (64) + reserve_connections (8)
INTERVAL_S = 0.3
PROBES = 60


def test_trickling_clients_never_lock_out_the_probes(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        host, port = cfg["admin"]["listen"].rsplit(":", 1)
        # The attack holds every slot (or is being cut) before the first probe.
        attack = TrickleProcess(host, int(port), CLIENTS, INTERVAL_S)
        with attack, Prober(d.admin, every=0.05, timeout=5.0) as prober:
            while len(prober.summary.results) < PROBES:
                prober.stop.wait(0.05)
        s = prober.summary
        print(
            f"\n{len(s.results)} probes under {CLIENTS} trickling clients: /livez p99 "
            f"{s.quantile(0.99, '/livez') * 1000:.0f} ms, slowest {s.slowest() * 1000:.0f} ms; "
            f"{attack.stats['connections']} attacking connections, {attack.stats['cut']} cut"
        )
        assert s.failures == [], s.failures[:5]
        assert {r.path for r in s.results} == {"/livez", "/readyz", "/metrics"}
        assert attack.stats["cut"] > 0  # the attack was at the limit: its connections were cut
        assert d.status()["restarts"] == {}
        assert "stopping" not in d.states()
