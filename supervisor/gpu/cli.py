"""`kimi-serve gpu-clean`: GPU cleaning from the command line, with the daemon stopped.

Reads the launch record as the daemon's user would, runs `supervisor.gpu.clean.clean()` once
and prints the GPUs before and after and what each process on them is.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, TextIO

import psutil

from supervisor.config import Config
from supervisor.gpu.clean import CleanReport, _short, _size, clean
from supervisor.gpu.nvml import NvmlOpener, NvmlUnavailable
from supervisor.process.identity import ProcessIdentity, RecordStore, descendants, owner_marker

# --------------------------------------------------------------------------------------------
# `kimi-serve gpu-clean`
# --------------------------------------------------------------------------------------------


def _daemon_uid(state_dir: str) -> int:
    # The daemon's user owns its state directory (systemd's StateDirectory= chowns it to User=):
    # an operator running gpu-clean as root must still treat only that user's processes as ours.
    # Anyone else can signal only their own processes: theirs are the ones that count (a pod's
    # `kubectl exec` runs as the daemon's user, in a state directory the kubelet made root's).
    if os.geteuid() != 0:
        return os.getuid()
    try:
        return os.stat(state_dir).st_uid
    except OSError:
        return os.getuid()


def _running_daemon(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        cmd = " ".join(proc.cmdline())
        named = "kimi-serve" in cmd or "supervisor" in cmd
        return named and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _print_gpus(out: TextIO, title: str, gpus: list[dict[str, Any]]) -> None:
    out.write(f"{title}\n  {'GPU':<4} {'UUID':<42} {'USED':>10} {'TOTAL':>10}  PROCESSES\n")
    for g in gpus:
        pids = ",".join(str(p) for p in g["processes"]) or "-"
        out.write(
            f"  {g['index']:<4} {g['uuid']:<42} {_size(g['memory_used_bytes']):>10} "
            f"{_size(g['memory_total_bytes']):>10}  {pids}\n"
        )


def _print_found(out: TextIO, report: CleanReport) -> None:
    if not report.found:
        out.write("Processes: none on the managed GPUs\n")
        return
    out.write(
        f"Processes:\n  {'PID':<8}  {'GPU':<5}  {'MEMORY':>9}  {'KIND':<8}  {'ACTION':<38}  "
        "USER  COMMAND / WHY\n"
    )
    for c in report.found:
        pid = "-" if c.pid is None else str(c.pid)
        gpus = ",".join(str(g) for g in c.gpus) or "-"
        action = report.actions.get(c.pid, "-") if c.pid is not None else "-"
        out.write(
            f"  {pid:<8}  {gpus:<5}  {_size(c.used_bytes):>9}  {c.kind.value:<8}  "
            f"{action:<38}  {c.user or '?'}  {_short(c.cmdline, 70) or '-'}  [{c.reason}]\n"
        )


def run_gpu_clean(cfg: Config, dry_run: bool, out: TextIO, open_nvml: NvmlOpener) -> int:
    """The body of `kimi-serve gpu-clean`: 0 when the managed GPUs are free, else 1."""
    if not cfg.gpus.manage:
        out.write("GPU management is off (gpus.manage: false); nothing to do\n")
        return 0
    store = RecordStore(cfg.state_dir)
    if store.path.exists() and not os.access(store.path, os.R_OK):
        out.write(
            f"warning: cannot read {store.path} (permission); recorded leftovers whose command "
            "line does not match gpus.match will be missed: run as root or the daemon's user\n"
        )
    uid = _daemon_uid(cfg.state_dir)
    read = store.read(uid)
    for line in read.warnings:
        out.write(f"warning: {line}\n")
    record = read.record
    recorded = read.processes
    current: set[ProcessIdentity] = set()
    if record and record.daemon_pid != os.getpid() and _running_daemon(record.daemon_pid):
        out.write(
            f"a kimi-serve daemon (pid {record.daemon_pid}) is running and owns the recorded "
            "processes: reporting only; stop it first to clean\n"
        )
        current = recorded | set(descendants(record.daemon_pid))
        recorded, dry_run = set(), True
    try:
        nvml = open_nvml()
    except NvmlUnavailable as exc:
        out.write(f"error: {exc}\n")
        return 1
    try:
        report = asyncio.run(
            clean(
                cfg.gpus,
                nvml,
                current=current,
                recorded=recorded,
                dry_run=dry_run,
                daemon_uid=uid,
                owner=owner_marker(cfg.state_dir),
            )
        )
    finally:
        nvml.close()
    policy = "dry run" if dry_run else f"policy {cfg.gpus.leftover_policy}"
    devices = "all" if cfg.gpus.devices == "all" else ",".join(map(str, cfg.gpus.devices))
    out.write(
        f"gpus.devices: {devices}; {policy}; processes of uid {uid} matching "
        f"{list(cfg.gpus.match)} count as ours; {len(recorded)} recorded from earlier launches\n"
    )
    if report.before:
        _print_gpus(out, "GPUs before:", report.before)
    _print_found(out, report)
    if report.after and not dry_run:
        _print_gpus(out, "GPUs after:", report.after)
    for w in report.wedged:
        out.write(f"wedged: {w}\n")
    out.write(("ok: " if report.ok else "not clean: ") + report.message + "\n")
    return 0 if report.ok else 1
