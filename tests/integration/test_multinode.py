"""A multi-node replica's two nodes on one machine: two real daemons, two stand-ins in
multi-node mode (rank 0 and rank 1 meet at --dist-init-addr; a dead peer makes the other
hang, not exit), coordinated over their loopback admin endpoints with one shared token."""

from __future__ import annotations

import os
import signal
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from supervisor.gpu.sim import ENV_GPUS, ENV_HEALTH, ENV_TAG
from testkit import running
from testkit.pair import Proxy, launches, node_configs, ready, shared_token, until_all

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

# The stand-in's own load and warm-up per launch (base_config): excluded from the figures.
LOAD_S = 0.3 + 0.1


def node(tmp: Path, rank: int) -> Path:
    return tmp / f"node{rank}"


def both_ready(a: str, b: str) -> bool:
    return ready(a) and ready(b)


def neither_ready(a: str, b: str) -> bool:
    return not ready(a) and not ready(b)


def group(d: Any) -> dict[str, Any]:
    doc: dict[str, Any] = d.status()["group"]
    return doc


def peer_error(d: Any) -> str:
    """The follower's report about its leader; "" while its admin endpoint is not up yet."""
    try:
        return str(group(d)["peers"][0]["error"] or "")
    except httpx.HTTPError:
        return ""


def kill_and_measure(victim: Any, a: str, b: str, what: str) -> tuple[float, float]:
    os.kill(victim.sglang_pid(), signal.SIGKILL)
    down = until_all(lambda: neither_ready(a, b), 10, f"both 503 after {what}")
    up = until_all(lambda: both_ready(a, b), 30, f"both ready again after {what}")
    print(
        f"\n{what}: every node 503 after {down:.2f}s; group ready again after "
        f"{down + up:.2f}s ({down + up - LOAD_S:.2f}s without the stand-in's load)"
    )
    return down, up


def test_leader_only_readiness_and_group_relaunch_on_either_death(tmp_path: Path) -> None:
    leader_cfg, follower_cfg = node_configs(tmp_path)
    with running(node(tmp_path, 0), leader_cfg) as leader:
        # Alone, the leader's rank 0 waits at --dist-init-addr: never ready without its group.
        leader.wait_state("loading")
        assert not ready(leader.admin)
        with running(node(tmp_path, 1), follower_cfg) as follower:
            a, b = leader.admin, follower.admin
            leader.wait_state("ready")
            follower.wait_state("ready")
            until_all(lambda: both_ready(a, b), 10, "both ready")
            # The follower never probes its dummy server; it is ready on the leader's word.
            assert follower.status()["last_probe"] is None
            assert leader.status()["last_probe"]["ok"] is True
            lg, fg = group(leader), group(follower)
            assert lg["role"] == "leader" and fg["role"] == "follower"
            assert lg["epoch"] == fg["epoch"] is not None
            first = lg["epoch"]

            kill_and_measure(follower, a, b, "follower's SGLang SIGKILLed")
            assert follower.wait_state("restarting")["reason"] == "exited"
            assert leader.wait_state("restarting")["reason"] == "group"
            second = group(leader)["epoch"]
            assert second != first and group(follower)["epoch"] == second

            kill_and_measure(leader, a, b, "leader's SGLang SIGKILLed")
            assert leader.wait_state("restarting")["reason"] == "exited"
            assert follower.wait_state("restarting")["reason"] == "group"
            third = group(leader)["epoch"]
            assert third not in (first, second) and group(follower)["epoch"] == third
            assert launches(leader_cfg) == launches(follower_cfg) == 3


def test_follower_daemon_restarted(tmp_path: Path) -> None:
    leader_cfg, follower_cfg = node_configs(tmp_path)
    with running(node(tmp_path, 0), leader_cfg) as leader:
        with running(node(tmp_path, 1), follower_cfg) as follower:
            until_all(lambda: both_ready(leader.admin, follower.admin), 20, "both ready")
            first = group(leader)["epoch"]
            assert follower.stop() == 0
        # The follower's launch left the group: the leader ends the epoch at once.
        assert leader.wait_state("restarting")["reason"] == "group"
        with running(node(tmp_path, 1), follower_cfg) as follower:
            until_all(lambda: both_ready(leader.admin, follower.admin), 20, "both ready again")
            assert group(leader)["epoch"] != first


def test_partition_follower_reports_and_never_relaunches_alone(tmp_path: Path) -> None:
    proxies: list[Proxy] = []

    def through_proxy(url: str) -> str:
        proxy = Proxy(int(url.rsplit(":", 1)[1]))
        proxy.start()
        proxies.append(proxy)
        return proxy.url

    leader_cfg, follower_cfg = node_configs(tmp_path, through_proxy)
    (proxy,) = proxies
    try:
        with (
            running(node(tmp_path, 0), leader_cfg) as leader,
            running(node(tmp_path, 1), follower_cfg) as follower,
        ):
            a, b = leader.admin, follower.admin
            until_all(lambda: both_ready(a, b), 20, "both ready")
            before = launches(follower_cfg)
            proxy.stop()
            # At once: reported (status and metric), not ready (the leader's word is gone).
            until_all(lambda: not ready(b), 5, "the follower not ready")
            peer = group(follower)["peers"][0]
            assert peer["reachable"] is False
            metrics = httpx.get(b + "/metrics", timeout=5).text
            assert f'kimi_serve_group_peer_up{{peer="{proxy.url}"}} 0.0' in metrics
            # After partition_timeout it ends its own launch and waits: no launch alone.
            ended = follower.wait_state("restarting", timeout=10)
            assert ended["reason"] == "group" and "unreachable" in ended["detail"]
            follower.wait_state("cleaning")
            until_all(lambda: not ready(a), 10, "the leader ended its epoch")
            assert launches(follower_cfg) == before
            assert follower.status()["state"] == "cleaning"
            proxy.start()
            until_all(lambda: both_ready(a, b), 20, "both ready after the partition")
            assert launches(follower_cfg) == before + 1
    finally:
        proxy.stop()


def test_group_endpoints_need_the_token(tmp_path: Path) -> None:
    leader_cfg, follower_cfg = node_configs(tmp_path)
    # A follower presenting another token: the leader refuses it, so it never joins.
    other = shared_token(node(tmp_path, 1))
    follower_cfg["group"]["token_file"] = str(other)
    with (
        running(node(tmp_path, 0), leader_cfg) as leader,
        running(node(tmp_path, 1), follower_cfg) as follower,
    ):
        leader.wait_state("loading")
        until_all(lambda: "401" in peer_error(follower), 30, "a 401 reported")
        assert follower.status()["state"] == "cleaning" and launches(follower_cfg) == 0
        denied = httpx.get(leader.admin + "/metrics", timeout=5).text
        assert 'kimi_serve_admin_denied_total{endpoint="/group"}' in denied
        wrong = {"Authorization": "Bearer " + "x" * 43}
        assert httpx.get(leader.admin + "/group", timeout=5).status_code == 401
        assert httpx.get(leader.admin + "/group", headers=wrong, timeout=5).status_code == 401
        r = httpx.post(leader.admin + "/group/end", json={"epoch": "e"}, timeout=5)
        assert r.status_code == 401
        r = httpx.get(leader.admin + "/group", headers=leader.auth(), timeout=5)
        assert r.status_code == 200 and r.json()["role"] == "leader"
        # A stale epoch is refused and ends nothing.
        r = httpx.post(
            leader.admin + "/group/end", json={"epoch": "old"}, headers=leader.auth(), timeout=5
        )
        assert r.status_code == 200 and r.json()["accepted"] is False


# ------------------------------------------------------------------ the Kubernetes shape


def kubernetes_shape(leader_cfg: dict[str, Any], follower_cfg: dict[str, Any]) -> dict[str, str]:
    """As packaging/kubernetes/multi-node has it: one `group.leader` URL with a variable from
    the environment on both nodes (LWS_LEADER_ADDRESS there), so the follower polls the leader
    and the leader polls no one. Returns the environment both daemons need."""
    for cfg in (leader_cfg, follower_cfg):
        del cfg["group"]["peers"]
        cfg["group"]["leader"] = "http://${TEST_LEADER_ADMIN}"
    return {"TEST_LEADER_ADMIN": leader_cfg["admin"]["listen"]}


def metric(admin: str, line_start: str) -> str:
    text = httpx.get(admin + "/metrics", timeout=5).text
    return next(line for line in text.splitlines() if line.startswith(line_start))


def at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def unfit_gpu_env(tmp: Path, env: dict[str, str]) -> dict[str, str]:
    """Simulated NVML (supervisor/gpu/sim.py) with GPU 0 needing a reset."""
    (tmp / "health").write_text("0:remap_pending")
    return {
        **env,
        ENV_GPUS: "2",
        ENV_TAG: f"multinode-{uuid.uuid4().hex[:12]}",
        ENV_HEALTH: f"@{tmp / 'health'}",
    }


def test_a_failed_follower_ends_each_leader_epoch_at_once(tmp_path: Path) -> None:
    leader_cfg, follower_cfg = node_configs(tmp_path)
    follower_cfg["gpus"] = {"manage": True}
    with running(node(tmp_path, 0), leader_cfg) as leader:
        leader.wait_state("loading")
        env = unfit_gpu_env(tmp_path, {})
        with running(node(tmp_path, 1), follower_cfg, env=env) as follower:
            failed = follower.wait_state("failed")
            assert failed["reason"] == "gpu_unfit" and "needs a reset" in failed["detail"]
            # Each epoch the leader starts ends within a poll or two, not at load_timeout
            # (20 s here; 30 min in production) nor after NCCL's watchdog.
            since, what = at(failed), "the follower failed"
            for n in (1, 2):
                ended = leader.wait_state("restarting", timeout=10)
                assert ended["reason"] == "group" and "follower failed" in ended["detail"]
                print(f"\nepoch {n} ended {at(ended) - since:.2f}s after {what}")
                since, what = at(leader.wait_state("launching")), "it launched"
            assert launches(follower_cfg) == 0
            assert follower.status()["state"] == "failed"


def test_kubernetes_shape_a_failed_follower_makes_the_leader_exit_for_the_group(
    tmp_path: Path,
) -> None:
    leader_cfg, follower_cfg = node_configs(tmp_path)
    env = kubernetes_shape(leader_cfg, follower_cfg)
    leader_cfg["restart"]["mode"] = follower_cfg["restart"]["mode"] = "exit"
    follower_cfg["gpus"] = {"manage": True}
    with running(node(tmp_path, 0), leader_cfg, env=env) as leader:
        leader.wait_state("loading")
        assert group(leader)["peers"] == []  # polls no one, answers GET /group
        with running(node(tmp_path, 1), follower_cfg, env=unfit_gpu_env(tmp_path, env)) as f:
            failed = f.wait_state("failed")
            # The follower's POST /group/end is the only way the leader hears it here.
            stopping = leader.wait_state("stopping", timeout=10)
            assert "follower failed (gpu_unfit" in stopping["detail"], stopping
            assert leader.proc.wait(30) == 75  # the LeaderWorkerSet recreates the group
            print(f"\nthe leader exited for the group {at(stopping) - at(failed):.2f}s after")


def test_kubernetes_shape_the_follower_s_readyz_and_ready_metric_follow_the_leader(
    tmp_path: Path,
) -> None:
    leader_cfg, follower_cfg = node_configs(tmp_path)
    env = kubernetes_shape(leader_cfg, follower_cfg)
    follower_cfg["group"]["partition_timeout"] = "60s"  # the follower's own launch stays up
    with (
        running(node(tmp_path, 0), leader_cfg, env=env) as leader,
        running(node(tmp_path, 1), follower_cfg, env=env) as follower,
    ):
        a, b = leader.admin, follower.admin
        until_all(lambda: both_ready(a, b), 20, "both ready")
        assert group(follower)["peers"][0]["url"] == a
        assert metric(b, "kimi_serve_ready ") == "kimi_serve_ready 1.0"
        leader.signal(signal.SIGSTOP)  # the leader's word goes missing; its SGLang runs on
        try:
            until_all(lambda: not ready(b), 5, "the follower's /readyz 503")
            assert metric(b, "kimi_serve_ready ") == "kimi_serve_ready 0.0"
            assert follower.status()["state"] == "ready"  # its own processes still live
        finally:
            leader.signal(signal.SIGCONT)
        until_all(lambda: ready(b), 10, "the follower ready again")
        assert metric(b, "kimi_serve_ready ") == "kimi_serve_ready 1.0"

        # A reload that would change the follower's leader is refused, with its reason.
        before = launches(follower_cfg)
        changed = {**follower_cfg, "group": {**follower_cfg["group"], "leader": "http://x:1"}}
        follower.config_path.write_text(yaml.safe_dump(changed))
        follower.signal(signal.SIGHUP)
        refused = follower.wait_for(
            lambda e: e.get("event") == "reload refused: keeping the running configuration",
            what="the refusal",
        )
        assert "group.peers changed" in refused["why"], refused
        doc = follower.status()
        assert doc["reload_refused"] == refused["why"] and doc["state"] == "ready"
        assert doc["group"]["peers"][0]["url"] == a and launches(follower_cfg) == before
