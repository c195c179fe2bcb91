"""Cleaning against real processes; only NVML is simulated (it reports them as GPU processes).

Each test asserts on who is still alive afterwards: only leftovers may ever be killed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping

import psutil

from supervisor.gpu import Kind, ProcFacts, clean, gather_facts
from supervisor.gpu.nvml import GpuSnapshot, NvmlUnavailable
from supervisor.gpu.sim import SimulatedNvml, simulated_uuid
from supervisor.process.identity import ProcessIdentity, live_process
from testkit.gpu import Procs, gpus_cfg

FAST = {"term_grace": 0.5, "poll": 0.02}


def alive(ident: ProcessIdentity) -> bool:
    return live_process(ident) is not None


async def test_only_leftovers_are_killed(procs: Procs) -> None:
    sim = SimulatedNvml(gpus=2, mib_per_process=512, tag=procs.tag)
    orphan = procs.start("sglang::scheduler_TP0", orphan=True)
    stubborn = procs.start("sglang::scheduler_TP1", ignore_term=True)
    main = procs.start("-m", "launch_server", "--sim-gpu", "1", orphan=True)
    # Recorded, holds no GPU memory, ignores SIGTERM: still waited for after its SIGKILL.
    detok = procs.start("sglang::detokenizer", ignore_term=True)
    foreign = procs.start("train.py", "--sim-gpu", "0")  # 512 MiB, under the threshold
    bystander = procs.start("sglang-unrelated-but-no-gpu")  # matches, not on a GPU, not recorded
    current = procs.start("sglang::scheduler_TP1")
    assert psutil.Process(orphan.pid).ppid() != os.getpid()

    report = await clean(
        gpus_cfg(),
        sim,
        current={current},
        recorded={detok},
        **FAST,  # type: ignore[arg-type]
    )

    assert report.ok, report.message
    assert not any(map(alive, (orphan, stubborn, main, detok)))
    assert all(map(alive, (foreign, bystander, current)))
    kinds = {c.pid: c.kind for c in report.found}
    assert kinds == {
        orphan.pid: Kind.LEFTOVER,
        stubborn.pid: Kind.LEFTOVER,
        main.pid: Kind.LEFTOVER,
        detok.pid: Kind.LEFTOVER,
        foreign.pid: Kind.FOREIGN,
        current.pid: Kind.CURRENT,
    }
    assert report.killed == {0: 1, 1: 2}
    assert report.actions[orphan.pid] == "SIGTERM: exited"
    assert report.actions[stubborn.pid] == "SIGTERM, SIGKILL: exited"
    assert report.actions[detok.pid] == "SIGTERM, SIGKILL: exited"
    assert [c.pid for c in report.foreign] == [foreign.pid]
    assert report.release_seconds is not None and report.release_seconds < 3.0
    assert "removed 4 leftover process(es) (GPU 0: 1, GPU 1: 2)" in report.message
    assert f"foreign process(es) left alone (pid {foreign.pid})" in report.message
    assert [g["processes"] for g in report.after] == [[foreign.pid], [current.pid]]
    json.dumps(report.to_dict())


async def test_recorded_identity_with_another_start_time_is_not_killed(procs: Procs) -> None:
    sim = SimulatedNvml(gpus=1, tag=procs.tag)
    reused = procs.start("some-other-program")
    fake_record = {ProcessIdentity(reused.pid, reused.create_time - 30.0)}
    report = await clean(gpus_cfg(), sim, current=set(), recorded=fake_record, **FAST)  # type: ignore[arg-type]
    assert report.ok and report.found == [] and alive(reused)


async def test_identity_is_checked_again_right_before_the_signal(procs: Procs) -> None:
    # Facts that name another start time stand for "the pid was reused after classification".
    sim = SimulatedNvml(gpus=1, tag=procs.tag)
    leftover = procs.start("sglang::scheduler_TP0")

    def stale(pids: Iterable[int]) -> Mapping[int, ProcFacts]:
        real = gather_facts(pids)
        f = real[leftover.pid]
        return {**real, leftover.pid: dataclasses.replace(f, create_time=f.create_time - 30.0)}

    report = await clean(
        gpus_cfg(memory_free_timeout=0.2),
        sim,
        current=set(),
        recorded=set(),
        facts=stale,
        **FAST,  # type: ignore[arg-type]
    )
    assert alive(leftover)
    assert report.actions[leftover.pid].startswith("not signalled: the pid now names another")
    assert not report.ok and report.killed == {}


async def test_report_only_never_kills(procs: Procs) -> None:
    sim = SimulatedNvml(gpus=1, tag=procs.tag)
    leftover = procs.start("sglang::scheduler_TP0", orphan=True)
    recorded = procs.start("worker-without-gpu")
    report = await clean(
        gpus_cfg(leftover_policy="report-only", memory_free_timeout=0.2),
        sim,
        current=set(),
        recorded={recorded},
        **FAST,  # type: ignore[arg-type]
    )
    assert alive(leftover) and alive(recorded)
    assert not report.ok and report.killed == {} and report.wedged == []
    assert report.actions[leftover.pid] == "left running (gpus.leftover_policy: report-only)"
    assert f"held by pid {leftover.pid} (leftover" in report.message


async def test_dry_run_never_kills_and_does_not_wait(procs: Procs) -> None:
    sim = SimulatedNvml(gpus=1, tag=procs.tag)
    leftover = procs.start("sglang::scheduler_TP0")
    started = time.monotonic()
    report = await clean(
        gpus_cfg(memory_free_timeout=30.0),
        sim,
        current=set(),
        recorded=set(),
        dry_run=True,
        **FAST,  # type: ignore[arg-type]
    )
    assert time.monotonic() - started < 5.0
    assert alive(leftover)
    assert report.dry_run and not report.ok and report.release_seconds is None
    assert report.actions == {leftover.pid: "dry run: would SIGTERM, then SIGKILL"}
    assert report.message.startswith("dry run: GPU 0 ")


async def test_dry_run_on_free_gpus_is_ok(procs: Procs) -> None:
    report = await clean(
        gpus_cfg(),
        SimulatedNvml(gpus=2, tag=procs.tag),
        current=set(),
        recorded=set(),
        dry_run=True,
    )
    assert report.ok and report.message == "GPUs 0,1 free"


async def test_memory_wait_times_out_naming_gpu_memory_and_holder(procs: Procs) -> None:
    sim = SimulatedNvml(gpus=2, tag=procs.tag)
    foreign = procs.start("python", "train.py", "--sim-gpu", "1")
    started = time.monotonic()
    report = await clean(
        gpus_cfg(memory_free_timeout=0.3),
        sim,
        current=set(),
        recorded=set(),
        **FAST,  # type: ignore[arg-type]
    )
    assert 0.3 <= time.monotonic() - started < 3.0
    assert alive(foreign)
    assert not report.ok and report.wedged == [] and report.release_seconds is None
    assert report.message.startswith(f"GPU 1 ({simulated_uuid(1)[:12]}) still holds 4.0 GiB after ")
    assert f"held by pid {foreign.pid} (foreign, " in report.message
    assert "free means under 1024 MiB" in report.message


async def test_our_unreaped_child_is_reaped(procs: Procs) -> None:
    child = procs.start("sglang::scheduler_TP0")
    os.kill(child.pid, signal.SIGKILL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
    assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    report = await clean(
        gpus_cfg(),
        SimulatedNvml(gpus=1, tag=procs.tag),
        current=set(),
        recorded={child},
        **FAST,  # type: ignore[arg-type]
    )
    assert report.ok, report.message
    assert [(c.pid, c.kind, c.ours) for c in report.found] == [(child.pid, Kind.ZOMBIE, True)]
    assert report.actions == {child.pid: "reaped"}
    assert not psutil.pid_exists(child.pid)


async def test_zombie_of_another_parent_is_left_to_it(procs: Procs) -> None:
    child = procs.start("sglang::scheduler_TP0")
    os.kill(child.pid, signal.SIGKILL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    not_me = {**gather_facts([child.pid])}
    not_me[child.pid] = dataclasses.replace(not_me[child.pid], ppid=1)
    report = await clean(
        gpus_cfg(),
        SimulatedNvml(gpus=1, tag=procs.tag),
        current=set(),
        recorded={child},
        facts=lambda pids: not_me,
        **FAST,  # type: ignore[arg-type]
    )
    assert report.ok and report.actions == {child.pid: "left for its parent (pid 1) to reap"}
    assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE


async def test_matching_process_of_another_user_is_never_killed(procs: Procs) -> None:
    leftover_looking = procs.start("sglang::scheduler_TP0")
    report = await clean(
        gpus_cfg(memory_free_timeout=0.1),
        SimulatedNvml(gpus=1, tag=procs.tag),
        current=set(),
        recorded=set(),
        daemon_uid=os.getuid() + 1,
        **FAST,  # type: ignore[arg-type]
    )
    assert alive(leftover_looking)
    assert [c.kind for c in report.foreign] == [Kind.FOREIGN] and not report.ok


async def test_another_daemons_launch_is_foreign(procs: Procs) -> None:
    procs.env["KIMI_SERVE_OWNER"] = "/var/lib/kimi-serve-other"
    theirs = procs.start("sglang::scheduler_TP0")
    procs.env["KIMI_SERVE_OWNER"] = "/var/lib/kimi-serve"
    ours = procs.start("not-matching-at-all", "--sim-gpu", "0")
    report = await clean(
        gpus_cfg(memory_free_timeout=0.1),
        SimulatedNvml(gpus=1, tag=procs.tag),
        current=set(),
        recorded=set(),
        owner="/var/lib/kimi-serve",
        **FAST,  # type: ignore[arg-type]
    )
    assert alive(theirs) and not alive(ours)
    assert {c.pid: c.kind for c in report.found} == {
        theirs.pid: Kind.FOREIGN,
        ours.pid: Kind.LEFTOVER,
    }


async def test_memory_held_with_no_process_is_reported_as_wedged(procs: Procs) -> None:
    sim = SimulatedNvml(gpus=2, wedged_mib={1: 2048}, tag=procs.tag)
    report = await clean(
        gpus_cfg(memory_free_timeout=0.1),
        sim,
        current=set(),
        recorded=set(),
        **FAST,  # type: ignore[arg-type]
    )
    assert not report.ok
    assert report.wedged == ["GPU 1: 2.0 GiB held with no process listed by NVML"]
    assert "GPU 1" in report.message and "2.0 GiB" in report.message
    assert "retrying cannot help" in report.message


class BrokenNvml:
    """Answers once, then the GPU falls off the bus."""

    def __init__(self, first: list[GpuSnapshot]) -> None:
        self.first: list[GpuSnapshot] | None = first

    def snapshot(self) -> list[GpuSnapshot]:
        if self.first is None:
            raise NvmlUnavailable("GPU 0: the GPU is lost")
        first, self.first = self.first, None
        return first

    def close(self) -> None:
        pass


async def test_nvml_failure_is_a_report_not_an_exception(procs: Procs) -> None:
    snaps = SimulatedNvml(gpus=1, tag=procs.tag).snapshot()
    report = await clean(gpus_cfg(), BrokenNvml(snaps), current=set(), recorded=set(), **FAST)  # type: ignore[arg-type]
    assert not report.ok and report.wedged == ["GPU 0: the GPU is lost"]
    assert report.message == "GPU 0: the GPU is lost"


async def test_unknown_device_is_a_report(procs: Procs) -> None:
    report = await clean(
        gpus_cfg(devices=(0, 5)),
        SimulatedNvml(gpus=2, tag=procs.tag),
        current=set(),
        recorded=set(),
    )
    assert not report.ok and "gpus.devices names 5" in report.message


async def test_only_managed_gpus_are_looked_at(procs: Procs) -> None:
    elsewhere = procs.start("sglang::scheduler_TP1")  # on GPU 1, which is not ours
    report = await clean(
        gpus_cfg(devices=(simulated_uuid(0),)),
        SimulatedNvml(gpus=2, tag=procs.tag),
        current=set(),
        recorded=set(),
        **FAST,  # type: ignore[arg-type]
    )
    assert report.ok and report.found == [] and alive(elsewhere)
    assert report.message == "GPU 0 free; no leftovers"


def in_d_state(pid: int) -> Callable[[Iterable[int]], Mapping[int, ProcFacts]]:
    """Facts in which `pid` sleeps uninterruptibly (no test can put a process there for real)."""

    def facts(pids: Iterable[int]) -> Mapping[int, ProcFacts]:
        real = gather_facts(pids)
        if pid in real:
            real[pid] = dataclasses.replace(real[pid], status=psutil.STATUS_DISK_SLEEP)
        return real

    return facts


async def test_process_stuck_in_d_state_makes_the_gpu_wedged(procs: Procs) -> None:
    stuck = procs.start("python", "train.py", "--sim-gpu", "0")
    report = await clean(
        gpus_cfg(memory_free_timeout=0.1),
        SimulatedNvml(gpus=1, tag=procs.tag),
        current=set(),
        recorded=set(),
        facts=in_d_state(stuck.pid),
        **FAST,  # type: ignore[arg-type]
    )
    assert alive(stuck)  # not ours: never signalled
    assert not report.ok and report.actions == {}
    assert len(report.wedged) == 1
    assert report.wedged[0].startswith(f"GPU 0: pid {stuck.pid} stuck in the driver (D state)")
    assert f"held by pid {stuck.pid} stuck in the driver (D state) (stuck, " in report.message
    assert report.message.endswith(
        "GPU wedged: retrying cannot help, it needs a GPU reset or a reboot"
    )


async def test_our_process_in_d_state_is_still_sent_the_signals(procs: Procs) -> None:
    # A SIGKILL to a D-state process stays pending and lands when it leaves the driver.
    ours = procs.start("sglang::scheduler_TP0")
    report = await clean(
        gpus_cfg(),
        SimulatedNvml(gpus=1, tag=procs.tag),
        current=set(),
        recorded=set(),
        facts=in_d_state(ours.pid),
        **FAST,  # type: ignore[arg-type]
    )
    assert [c.kind for c in report.found] == [Kind.STUCK]
    assert report.ok and report.actions == {ours.pid: "SIGTERM: exited"} and not alive(ours)
