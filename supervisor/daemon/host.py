"""Cleaning the host before a launch: the `CleanHost` action, answered by one event.

In order: processes of earlier launches (the launch record, their session, the owner marker)
are removed and counted with the GPU memory each held, the managed GPUs' fitness is read, the
model paths and GPU count are checked, enough file descriptors are left, the GPUs are cleaned
until NVML shows their memory free, and the SGLang port is free. The answer is `HostReady`,
`GpuUnfit` (a GPU needs a reset, a reboot or a replacement), or `HostNotReady` saying why (with
`wedged` when retrying cannot help); the machine decides what to do with it (retry with a
backoff, or `failed`).
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable
from typing import TYPE_CHECKING

from supervisor import gpu, log, preflight
from supervisor.config import Config
from supervisor.core.machine import GpuUnfit, HostNotReady, HostReady
from supervisor.daemon.observed import Observed
from supervisor.gpu.nvml import Nvml, select
from supervisor.process import ProcessOwner
from supervisor.process.identity import RecordStore
from supervisor.sglang import argv
from supervisor.threads import in_thread

if TYPE_CHECKING:
    from supervisor.gpu.fitness_watch import Monitor

HOST_CHECK_TIMEOUT_S = 30.0
# Leave this many file descriptors free before a launch (SGLang's pipes, pidfd, probes).
FD_HEADROOM = 64


def gpu_counter(nvml: Nvml, cfg: Config) -> Callable[[], int]:
    return lambda: len(select(nvml.snapshot(), cfg.gpus.devices))


async def clean(
    cfg: Config,
    profile: str,
    store: RecordStore,
    owner: ProcessOwner,
    nvml: Nvml | None,
    observed: Observed,
    monitor: Monitor | None = None,
) -> HostReady | HostNotReady | GpuUnfit:
    """Leftovers of earlier launches gone, GPUs fit, GPU memory free, port free: or say why
    not (`GpuUnfit`: a managed GPU needs a reset, a reboot or a replacement)."""
    try:
        # The record is the service user's file: bound to its owner, mode and boot
        # (RecordStore.read); what it cannot vouch for is ignored, with one warning each.
        read = store.read()
        for line in read.warnings:
            log.get().warning("launch record not trusted", detail=line)
        recorded = read.processes
        # The launch's session counts too: setproctitle wipes a scheduler's environment, and
        # with it the owner marker (ProcessOwner.evident).
        marked = owner.evident(recorded)
        if recorded | marked:
            log.get().warning(
                "removing processes of an earlier launch",
                pids=sorted(i.pid for i in recorded | marked),
            )
        # Always reported, empty when nothing was left (Observed sums the cleanings up to a
        # launch).
        sweep = await gpu.sweep_leftovers(
            owner.sweep, nvml, recorded, marked, match=cfg.gpus.match, owner=owner.owner
        )
        for line in sweep.spared:
            log.get().warning("recorded process left alone", detail=line)
        observed.swept(sweep)
        if sweep.stuck:
            pids = ", ".join(str(i.pid) for i in sweep.stuck)
            return HostNotReady(
                f"process {pids} of an earlier launch survives SIGKILL "
                "(stuck in the kernel, D state): the host needs attention",
                wedged=True,
            )
        store.clear()
        if monitor is not None:
            # Never launch onto a GPU that needs a reset: the machine goes `failed` with the line.
            # Before the host checks: a lost GPU also fails their GPU count, which is retried as
            # a problem that may clear by itself, and it never does.
            unfit = await monitor.before_launch()
            if unfit is not None:
                return unfit
        # Paths on a mount not up yet, GPUs missing: host problems that may clear by themselves.
        spec = argv.build(cfg, profile)
        gpu_count = gpu_counter(nvml, cfg) if nvml is not None else None
        try:
            checks = await in_thread(
                lambda: preflight.host_checks(cfg, [spec], gpu_count), HOST_CHECK_TIMEOUT_S
            )
        except TimeoutError:
            limit = f"{HOST_CHECK_TIMEOUT_S:g}s"
            return HostNotReady(f"model path checks did not return within {limit} (hung mount?)")
        problems = preflight.failures(checks)
        if problems:
            missing = any(c.name in preflight.MODEL_CHECKS for c in problems)
            return HostNotReady(preflight.summary(problems), model_missing=missing)
        fds = free_fds()
        if fds is not None and fds < FD_HEADROOM:
            # Spawning would fail with EMFILE and count as a crash; it is the host's problem (often
            # a scraper leaking connections to the admin port) and it can clear.
            return HostNotReady(
                f"only {fds} file descriptors left to kimi-serve (RLIMIT_NOFILE); "
                "leaked admin connections?"
            )
        if cfg.gpus.manage and nvml is not None:
            # No launch of ours runs during cleaning, so nothing is `current`.
            report = await gpu.clean(
                cfg.gpus, nvml, current=set(), recorded=recorded, owner=owner.owner
            )
            observed.cleaned(report)
            if not report.ok:
                return HostNotReady(report.message, wedged=bool(report.wedged))
        # After GPU cleaning: a leftover SGLang found only there may be what holds the port.
        port = preflight.check_port(cfg.sglang.host, cfg.sglang.port)
        if not port.ok:
            return HostNotReady(f"{port.message} (sglang.port)")
        return HostReady()
    except OSError as exc:
        # EMFILE, a vanished /proc entry, an unreadable state dir: the host's problem, and one
        # that can clear; never a reason to stop supervising.
        return HostNotReady(f"cannot check the host: {exc}")


def free_fds() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        return soft - len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def raise_fd_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: SGLang and the admin endpoint share it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
