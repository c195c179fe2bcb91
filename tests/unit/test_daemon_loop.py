"""The daemon's loop in process, its effects injected: what it carries out for the machine."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import yaml

from supervisor import config as config_mod
from supervisor import router
from supervisor.core.machine import (
    ChildExited,
    ChildGone,
    FatalLog,
    ReloadRequested,
    State,
    StopRequested,
    Transitioned,
    Verdict,
)
from supervisor.daemon.effects import Effects
from supervisor.daemon.loop import Daemon
from supervisor.daemon.notify import Notifier
from supervisor.process import ProcessOwner
from supervisor.process.identity import RecordStore, owner_marker
from supervisor.sglang.logscan import Stream
from testkit import base_config


class Told(Notifier):
    """systemd as a list: every message the daemon sends."""

    def __init__(self) -> None:
        self.enabled = False
        self._sd = None
        self.said: list[str] = []

    def _send(self, message: str) -> None:
        self.said.append(message)


@pytest.fixture
async def daemon(tmp_path: Path) -> Daemon:
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(base_config(tmp_path)))
    cfg = config_mod.load(str(path))
    fx = Effects(
        owner=ProcessOwner(owner_marker(cfg.state_dir)),
        store=RecordStore(cfg.state_dir),
        http=httpx.AsyncClient(trust_env=False),
        notifier=Told(),
        clock=lambda: 100.0,
        wall=lambda: 1_700_000_000.0,
    )
    return Daemon(cfg, fx)


def told(d: Daemon) -> list[str]:
    assert isinstance(d.notifier, Told)
    return d.notifier.said


async def test_a_stop_with_nothing_running_exits_and_refuses_restarts(daemon: Daemon) -> None:
    assert daemon.request_restart() is None
    assert daemon.queue.qsize() == 1  # the request went to the machine
    daemon.dispatch(StopRequested("SIGTERM"))
    assert daemon.machine.state is State.STOPPED
    assert daemon._exit_code == 0
    assert daemon.request_restart() == "the daemon is stopping"
    # Both transitions come from one event: the line shows where the machine ended.
    assert told(daemon)[0] == "STOPPING=1\nSTATUS=stopped (primary)"
    doc = daemon.status_document()
    assert doc["state"] == "stopped" and doc["since"] == 1_700_000_000.0
    assert [(e["from"], e["to"]) for e in doc["events"]] == [
        ("starting", "stopping"),
        ("stopping", "stopped"),
    ]
    await daemon.fx.http.aclose()


async def test_a_reload_before_the_first_ready_is_status_only(daemon: Daemon) -> None:
    daemon.dispatch(ReloadRequested())
    item = await asyncio.wait_for(daemon.queue.get(), 60)  # the file, read off the loop
    daemon.dispatch(item)
    assert told(daemon) == ["STATUS=starting (primary)"]
    await daemon.fx.http.aclose()


async def test_a_reload_after_ready_opens_and_ends_a_reload_job(daemon: Daemon) -> None:
    daemon.machine.ctx.ever_ready = True
    daemon.dispatch(ReloadRequested())
    assert told(daemon)[0].startswith("RELOADING=1\nMONOTONIC_USEC=")
    daemon.dispatch(await asyncio.wait_for(daemon.queue.get(), 60))
    assert told(daemon)[1:] == ["READY=1\nSTATUS=starting (primary)"]
    await daemon.fx.http.aclose()


async def test_restarts_are_counted_once(daemon: Daemon) -> None:
    from supervisor.core.machine import Reason, RecordRestart

    daemon._do(RecordRestart(Reason.EXITED, 1, None, "exit code 1"))
    daemon._do(RecordRestart(Reason.EXITED, None, 9, "killed by signal 9"))
    daemon._do(RecordRestart(Reason.MANUAL, None, None, "requested"))
    assert daemon.status_document()["restarts"] == {"exited": 2, "manual": 1}
    text = daemon.render_metrics().decode()
    assert 'kimi_serve_restarts_total{reason="exited"} 2.0' in text
    assert 'kimi_serve_restarts_total{reason="manual"} 1.0' in text
    daemon._do(Transitioned(State.STARTING, State.CLEANING, "started"))
    assert told(daemon)[-1] == "STATUS=starting (primary)"
    await daemon.fx.http.aclose()


async def test_a_pending_traceback_is_dispatched_before_the_death_it_explains(
    daemon: Daemon,
) -> None:
    """SGLang logs the scheduler's traceback, then kills the group by signal 9 before the
    exception line is read: the death must reach the machine as that traceback first."""
    seen: list[object] = []
    daemon.machine.handle = lambda item, now: seen.append(item) or []  # type: ignore[method-assign]
    head = "[2026-12-01] Scheduler hit an exception: Traceback (most recent call last):"
    daemon.pump.lines(3, Stream.STDERR, [head, '  File "scheduler.py", line 4614'])
    assert daemon.pump.scanner.pending
    death = ChildExited(3, None, 9, process="sglang::scheduler (pid 7)")
    daemon.dispatch(death)
    assert seen == [FatalLog(3, head), death]
    # Settled once: the ChildGone that follows carries no second verdict.
    daemon.dispatch(ChildGone(3, None, 9))
    assert seen[2:] == [ChildGone(3, None, 9)]
    await daemon.fx.http.aclose()


async def test_a_pending_traceback_of_another_launch_is_not_settled_by_a_death(
    daemon: Daemon,
) -> None:
    seen: list[object] = []
    daemon.machine.handle = lambda item, now: seen.append(item) or []  # type: ignore[method-assign]
    daemon.pump.lines(4, Stream.STDERR, ["Scheduler hit an exception: Traceback (most recent"])
    daemon.dispatch(ChildGone(3, None, None))
    assert seen == [ChildGone(3, None, None)] and daemon.pump.scanner.pending
    await daemon.fx.http.aclose()


async def test_the_router_links_http_client_comes_from_the_effects(tmp_path: Path) -> None:
    """Effects.router_http makes each router link's client: at start, and for a link a reload
    adds (router.url set where it was null)."""
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(base_config(tmp_path, router={"url": "http://127.0.0.1:9"})))
    cfg = config_mod.load(str(path))
    made: list[httpx.AsyncClient] = []

    def router_http() -> httpx.AsyncClient:
        made.append(httpx.AsyncClient(trust_env=False))
        return made[-1]

    fx = Effects(
        owner=ProcessOwner(owner_marker(cfg.state_dir)),
        store=RecordStore(cfg.state_dir),
        http=httpx.AsyncClient(trust_env=False),
        router_http=router_http,
    )
    d = Daemon(cfg, fx)
    assert d.router is not None and d.router.client is made[0]
    without = config_mod.load(str(path))
    d.reconfigure(replace(without, router=replace(without.router, url=None)), Verdict.UNCHANGED)
    assert d.router is None and d.observed.router is None
    # /status.router keeps its shape without a router: url null, nothing registered.
    shown = d.observed.status_document()["router"]
    assert {k: shown[k] for k in ("url", "worker_url", "registered", "worker_id")} == {
        "url": None,
        "worker_url": None,
        "registered": False,
        "worker_id": None,
    }
    assert shown["last_error"] is None
    d.reconfigure(cfg, Verdict.UNCHANGED)
    assert d.router is not None and d.router.client is made[1] and len(made) == 2
    for link in (d.launcher.router, d.router):
        await router.close_link(link)
    await fx.http.aclose()


async def test_a_repeated_self_transition_is_one_event_counting_the_repeats(
    daemon: Daemon,
) -> None:
    """Another process holding SGLang's port: cleaning -> cleaning (host_not_ready) at every
    retry. The history keeps one entry for the run of them, and the changes around it."""
    times = iter(float(1_700_000_000 + n) for n in range(1000))
    daemon.observed.wall = lambda: next(times)
    daemon._do(Transitioned(State.STARTING, State.CLEANING, "started"))
    for n in range(200):  # more than the history holds
        busy = f"sglang.port 30000 is in use (try {n})"
        daemon._do(Transitioned(State.CLEANING, State.CLEANING, "host_not_ready", busy))
    daemon._do(Transitioned(State.CLEANING, State.LAUNCHING, "host ready"))
    events = daemon.status_document()["events"]
    assert [(e["from"], e["to"], e["reason"], e["count"]) for e in events] == [
        ("starting", "cleaning", "started", 1),
        ("cleaning", "cleaning", "host_not_ready", 200),
        ("cleaning", "launching", "host ready", 1),
    ]
    repeated = events[1]
    assert repeated["at"] == 1_700_000_001.0 and repeated["last_at"] == 1_700_000_200.0
    assert repeated["detail"].endswith("(try 199)")  # the newest reason it waits
    # Another reason is another entry; a later run of the same one starts its own count.
    daemon._do(Transitioned(State.LAUNCHING, State.LAUNCHING, "host_not_ready"))
    daemon._do(Transitioned(State.LAUNCHING, State.LAUNCHING, "other"))
    daemon._do(Transitioned(State.LAUNCHING, State.LAUNCHING, "host_not_ready"))
    tail = daemon.status_document()["events"][-3:]
    assert [(e["reason"], e["count"]) for e in tail] == [
        ("host_not_ready", 1),
        ("other", 1),
        ("host_not_ready", 1),
    ]
    await daemon.fx.http.aclose()


async def test_a_taken_reload_reaches_every_part_that_reads_the_configuration(
    daemon: Daemon,
) -> None:
    new = config_mod.load(daemon.cfg.path)
    assert new is not daemon.cfg
    parts = daemon.parts
    scanner = parts.pump.scanner
    daemon.reconfigure(new, Verdict.CHANGED)
    readers = [parts.machine, parts.observed, parts.launcher, parts.warm, parts.recorder]
    assert daemon.cfg is new and all(p.cfg is new for p in [*readers, parts.quality])
    assert parts.pump.scanner is not scanner  # the new fatal patterns and tail length
    # The parts read one another as wired: nothing is assigned onto them afterwards.
    assert parts.observed.recorder is parts.recorder and parts.launcher.recorder is parts.recorder
    assert parts.observed.quality is parts.quality and parts.observed.links is parts.links
    assert parts.launcher.links is parts.links and parts.recorder.load_extras == parts.warm.current
