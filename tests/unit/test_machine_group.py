"""The multi-node decisions (machine.leader_ends, follower_ends, follower_may_join,
group_ready), the follower's path to READY without a probe, never registered, and the
`group:` section."""

from __future__ import annotations

import dataclasses

import pytest

from supervisor import config
from supervisor.config import Config, ConfigError, GroupConfig, RouterConfig
from supervisor.core.machine import (
    GroupEnded,
    HostReady,
    Launched,
    Machine,
    PeerView,
    PortOpen,
    Reason,
    RouterRegister,
    Start,
    StartProbe,
    State,
    StopChild,
    Transitioned,
    follower_ends,
    follower_may_join,
    group_ready,
    leader_ends,
)

E = "n-1"
RUNNING = PeerView(E, "ready", running=True, ready=True)
STARTING = PeerView(E, "loading", running=True, ready=False)
GONE = PeerView(E, "restarting", running=False, ready=False)
OTHER = PeerView("n-2", "loading", running=True, ready=False)
FRESH = PeerView(None, "cleaning", running=False, ready=False)


# ------------------------------------------------------------------ leader_ends


@pytest.mark.parametrize(
    ("state", "peer", "joined", "gap", "ends"),
    [
        (State.READY, RUNNING, True, 0.0, False),
        (State.READY, GONE, True, 0.0, True),  # its SGLang died
        (State.READY, FRESH, True, 0.0, True),  # its daemon restarted
        (State.READY, OTHER, True, 0.0, True),
        (State.LOADING, FRESH, False, 0.0, False),  # not joined yet: load_timeout's business
        (State.LOADING, None, False, 99.0, False),  # never seen: not a partition
        (State.READY, None, True, 1.9, False),  # a short gap
        (State.READY, None, True, 2.0, True),  # partition_timeout
        (State.RESTARTING, GONE, True, 0.0, False),  # already ending
        (State.CLEANING, None, True, 99.0, False),
    ],
)
def test_leader_ends(
    state: State, peer: PeerView | None, joined: bool, gap: float, ends: bool
) -> None:
    assert (leader_ends(E, state, peer, joined, gap, 2.0) is not None) is ends


# ------------------------------------------------------------------ follower_ends


@pytest.mark.parametrize(
    ("mine", "state", "leader", "gap", "ends"),
    [
        (E, State.READY, RUNNING, 0.0, False),
        (E, State.READY, STARTING, 0.0, False),
        (E, State.READY, OTHER, 0.0, True),  # the leader relaunched (or restarted)
        (E, State.READY, GONE, 0.0, True),  # the leader says the epoch ended
        (E, State.READY, None, 1.0, False),
        (E, State.READY, None, 2.0, True),  # partition: ends its own launch
        (None, State.CLEANING, None, 99.0, False),  # waiting for the leader: nothing to end
        (E, State.RESTARTING, OTHER, 0.0, False),
    ],
)
def test_follower_ends(
    mine: str | None, state: State, leader: PeerView | None, gap: float, ends: bool
) -> None:
    assert (follower_ends(mine, state, leader, gap, 2.0) is not None) is ends


@pytest.mark.parametrize(
    ("leader", "last", "joins"),
    [
        (STARTING, None, True),
        (STARTING, E, False),  # never the same epoch twice
        (RUNNING, None, False),  # a formed group cannot be joined
        (GONE, None, False),
        (FRESH, None, False),
        (None, None, False),  # no leader: wait, never launch alone
    ],
)
def test_follower_may_join(leader: PeerView | None, last: str | None, joins: bool) -> None:
    assert follower_may_join(leader, last) is joins


@pytest.mark.parametrize(
    ("role", "state", "mine", "leader", "ready"),
    [
        ("leader", State.READY, E, None, True),
        ("leader", State.WARMING, E, None, False),
        ("follower", State.READY, E, RUNNING, True),
        ("follower", State.READY, E, STARTING, False),
        ("follower", State.READY, "n-0", RUNNING, False),  # another epoch
        ("follower", State.READY, E, None, False),  # partition
        ("follower", State.RESTARTING, E, RUNNING, False),
    ],
)
def test_group_ready(
    role: str, state: State, mine: str, leader: PeerView | None, ready: bool
) -> None:
    assert group_ready(role, state, mine, leader) is ready


# ------------------------------------------------------------------ the machine, per role

BASE = """
sglang:
  model_path: /m
  port: 30000
  args: {nnodes: 2, node-rank: RANK, dist-init-addr: "10.0.0.1:5000"}
group:
  peers: PEERS
"""


def cfg_for(rank: int, peers: str = '["http://10.0.0.2:29400"]') -> Config:
    return config.parse(BASE.replace("RANK", str(rank)).replace("PEERS", peers), "c.yaml")


def loaded(cfg: Config) -> Machine:
    m = Machine(cfg, 0.0)
    m.handle(Start(), 0.0)
    m.handle(HostReady(), 0.0)
    m.handle(Launched(1, 42), 0.0)
    return m


def test_a_follower_is_ready_when_its_server_listens_without_a_probe() -> None:
    cfg = dataclasses.replace(cfg_for(1), router=RouterConfig(url="http://r:1", worker_url="x"))
    m = loaded(cfg)
    actions = m.handle(PortOpen(1), 1.0)
    assert m.state is State.READY
    assert not [a for a in actions if isinstance(a, StartProbe | RouterRegister)]


def test_a_leader_probes_and_a_group_end_restarts_it_at_once() -> None:
    m = loaded(cfg_for(0))
    assert [a for a in m.handle(PortOpen(1), 1.0) if isinstance(a, StartProbe)]
    actions = m.handle(GroupEnded(1, "follower left"), 2.0)
    assert m.state is State.RESTARTING
    assert StopChild(1, graceful=False) in actions
    t = next(a for a in actions if isinstance(a, Transitioned))
    assert t.reason == Reason.GROUP


def test_a_group_end_of_an_earlier_launch_is_ignored() -> None:
    m = loaded(cfg_for(0))
    assert m.handle(GroupEnded(0, "old"), 1.0) == []


# ------------------------------------------------------------------ config


def test_roles_come_from_the_sglang_flags() -> None:
    assert cfg_for(0).group.role == "leader"
    assert cfg_for(1).group.role == "follower"
    one = config.parse("sglang: {model_path: /m}\n", "c.yaml")
    assert one.group == GroupConfig(token_file=one.admin.token_file)
    assert not one.group.coordinated and cfg_for(1).group.coordinated


@pytest.mark.parametrize(
    ("rank", "peers", "path"),
    [
        (1, '["http://a:1", "http://b:1"]', "group.peers"),  # a follower has one leader
        (0, '["http://a:1", "http://b:1"]', "group.peers"),  # 2 nodes: one follower
        (0, '["ftp://a"]', "group.peers"),
        (2, '["http://a:1"]', "sglang.args"),  # rank not below nnodes
    ],
)
def test_bad_group_config_names_the_key(rank: int, peers: str, path: str) -> None:
    with pytest.raises(ConfigError) as err:
        cfg_for(rank, peers)
    assert path in {i.path for i in err.value.issues}


def test_multi_node_without_peers_or_exit_mode_is_warned() -> None:
    cfg = cfg_for(1, "[]")
    assert any("relaunch alone" in w for w in config.warnings(cfg))
    exit_mode = config.parse(
        BASE.replace("RANK", "1").replace("PEERS", "[]") + "restart: {mode: exit}\n", "c.yaml"
    )
    assert not any("relaunch alone" in w for w in config.warnings(exit_mode))


def test_status_renders_the_group_and_a_partition() -> None:
    from supervisor.admin.status_command import render

    doc = {
        "state": "cleaning",
        "group": {
            "role": "follower",
            "node_rank": 1,
            "epoch": None,
            "ready": False,
            "peers": [
                {"url": "http://l:1", "reachable": False, "unreachable_s": 3.2, "error": "refused"}
            ],
        },
    }
    text = render(doc, 0.0)
    assert "Group: follower (node rank 1), epoch -, not ready" in text
    assert "peer http://l:1: UNREACHABLE for 3.2 s: refused" in text


# ------------------------------------------------------------------ group.py's small parts


def test_a_malformed_group_answer_counts_as_no_answer() -> None:
    from supervisor.daemon.group import parse_view

    ok = {"epoch": "a-1", "state": "ready", "running": True, "ready": True}
    assert parse_view(ok) == PeerView("a-1", "ready", True, True)
    assert parse_view({**ok, "epoch": None}) == PeerView(None, "ready", True, True)
    for bad in ([], {**ok, "running": "yes"}, {**ok, "epoch": 3}, {**ok, "state": None}):
        assert parse_view(bad) is None


def test_post_group_end_ends_only_the_current_epoch_of_a_running_leader() -> None:
    import httpx

    from supervisor.daemon.group import Group
    from supervisor.metrics import Metrics

    cfg = cfg_for(0)
    m = loaded(cfg)
    got: list[object] = []
    g = Group(cfg, m.ctx, httpx.AsyncClient(), got.append, lambda: 0.0, Metrics())
    current = g.epoch()
    assert current is not None and current.endswith("-1")
    assert g.end_requested({"epoch": "stale-1"})["accepted"] is False
    assert g.end_requested("not a mapping")["accepted"] is False
    assert got == []
    assert g.end_requested({"epoch": current, "why": "exited"}) == {
        "accepted": True,
        "epoch": current,
    }
    assert got == [GroupEnded(1, f"a follower ended epoch {current}: exited")]
    # A follower's endpoint never ends anything.
    f = Group(
        cfg_for(1), loaded(cfg_for(1)).ctx, httpx.AsyncClient(), got.append, lambda: 0.0, Metrics()
    )
    assert f.end_requested({"epoch": None})["accepted"] is False
