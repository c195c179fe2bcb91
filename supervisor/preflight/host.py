"""Preflight's checks of this host, one finding each: the interpreter, SGLang's port, the model
and draft model directories, the GPU count, the compile caches. supervisor/preflight/__init__.py
runs them with the SGLang parser checks; docs/preflight.md explains each."""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from supervisor.config import ArgValue, Config
from supervisor.preflight.result import CONFIG, HOST, Check
from supervisor.sglang import argv
from supervisor.sglang.argv import LaunchSpec


def check_interpreter(python: str) -> Check:
    name = "interpreter"
    if os.sep not in python:
        found = shutil.which(python)
        if found is None:
            return Check(
                name,
                False,
                CONFIG,
                f"sglang.python {python!r} is not on PATH",
                "set sglang.python to the absolute path of SGLang's virtualenv interpreter",
            )
        python = found
    if not os.path.lexists(python):
        return Check(
            name,
            False,
            CONFIG,
            f"sglang.python {python} does not exist",
            "set sglang.python to the interpreter of the virtualenv SGLang is installed in",
        )
    if not os.path.exists(python):
        return Check(
            name,
            False,
            CONFIG,
            f"sglang.python {python} is a broken link (to {os.readlink(python)})",
            "the Python the virtualenv was made from is gone (an OS upgrade?); recreate the "
            "virtualenv and reinstall SGLang",
        )
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        return Check(name, False, CONFIG, f"sglang.python {python} is not an executable file")
    return Check(name, True, CONFIG, python)


def check_port(host: str, port: int, in_use: Callable[[int], Check | str] | None = None) -> Check:
    """Bind host:port the way SGLang's HTTP server will (SO_REUSEADDR, as uvicorn sets it, so
    a socket in TIME_WAIT is not mistaken for a busy port). A port in use is given to `in_use`
    (`kimi-serve preflight`: is it the running daemon's own SGLang? serving.py), which answers
    with the check, or with why the holder is not known to be ours."""
    name, where = "port", f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return Check(
            name,
            False,
            HOST,
            f"cannot resolve sglang.host {host!r}: {exc.strerror}",
            "use an IP address, or fix name resolution on this host",
        )
    family, kind, proto, _, sockaddr = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            known = in_use(port) if in_use is not None else ""
            if isinstance(known, Check):
                return known
            return Check(
                name,
                False,
                HOST,
                f"{where} is in use{_holder(port)}",
                "SGLang binds its port only after the model has loaded, so this would fail the "
                "launch ten minutes in. A leftover SGLang? `kimi-serve gpu-clean --dry-run`; "
                f"or `ss -ltnp 'sport = :{port}'`"
                + (f"\nnot kimi-serve's own: {known}" if known else ""),
            )
        if exc.errno == errno.EACCES:
            return Check(
                name,
                False,
                CONFIG,
                f"not allowed to bind {where}: {exc.strerror}",
                "ports below 1024 need privileges; pick another sglang.port",
            )
        if exc.errno == errno.EADDRNOTAVAIL:
            return Check(
                name,
                False,
                HOST,
                f"{host} is not an address of this host (yet)",
                "an interface that is not up yet, or a wrong sglang.host",
            )
        return Check(name, False, HOST, f"cannot bind {where}: {exc.strerror or exc}")
    return Check(name, True, HOST, f"{where} is free")


def _holder(port: int) -> str:
    """' (held by pid N: name)' where psutil can see the listener; '' otherwise."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return ""
    for conn in conns:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return ""
            try:
                proc = psutil.Process(conn.pid)
                what = " ".join(proc.cmdline()[:4]) or proc.name()
            except psutil.Error:
                what = "?"
            return f" (held by pid {conn.pid}: {what})"
    return ""


# A hub repo id ("org/name"): SGLang downloads it at load time; nothing local to check.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_path(name: str, path: str, key: str, workdir: str | None = None) -> Check:
    """A model directory must exist and hold config.json.

    Missing, or an empty directory, is a host problem: the usual cause is a network mount not
    up yet (an unmounted mount point is an empty directory), which clears by itself. A directory
    with files but no config.json, or a file, is a config problem: the path points at the wrong
    place, and no restart will fix that.
    """
    local = Path(path).expanduser()
    if not local.is_absolute() and workdir:
        local = Path(workdir) / local
    if not local.exists():
        if not path.startswith((".", "/", "~")) and _REPO_ID.match(path):
            return Check(
                name,
                True,
                HOST,
                f"{key} {path!r} is not a local path; taken as a hub repo id (SGLang downloads "
                "it at load time)",
                skipped=True,
            )
        return Check(
            name,
            False,
            HOST,
            f"{key} {local} does not exist",
            "a network mount not up yet clears by itself; otherwise fix the path",
        )
    if not local.is_dir():
        return Check(
            name,
            False,
            CONFIG,
            f"{key} {local} is a file, not a model directory",
            "point it at the directory that holds config.json and the weights",
        )
    try:
        empty = not any(local.iterdir())
        has_config = (local / "config.json").is_file()
    except PermissionError:
        return Check(
            name,
            False,
            CONFIG,
            f"{key} {local} is not readable by this user",
            "SGLang runs as the daemon's user; give it read access",
        )
    if empty:
        return Check(
            name,
            False,
            HOST,
            f"{key} {local} is empty",
            "an unmounted mount point? it clears once the mount is up",
        )
    if not has_config:
        return Check(
            name,
            False,
            CONFIG,
            f"{key} {local} has no config.json",
            "point it at the model directory itself (the one holding config.json), not a parent",
        )
    return Check(name, True, HOST, f"{local} (config.json present)")


def _int_arg(args: Mapping[str, ArgValue], *names: str) -> int | None:
    for name in names:
        value = args.get(name)
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.isdigit():
            return int(value)
    return None


def gpus_needed(spec: LaunchSpec) -> int:
    """GPUs this host must have for one launch: tp x pp, split over --nnodes hosts."""
    pp = _int_arg(spec.args, "pp-size", "pipeline-parallel-size", "pp") or 1
    nnodes = _int_arg(spec.args, "nnodes") or 1
    return max(1, -(-(spec.tp_size * pp) // nnodes))


class GpuCountUnavailable(Exception):
    """Nothing can count GPUs here; the GPU check is skipped with this message."""


def check_gpus(
    cfg: Config, specs: Sequence[LaunchSpec], gpu_count: Callable[[], int] | None
) -> Check:
    name = "gpus"
    if not cfg.gpus.manage:
        return Check(name, True, HOST, "not checked: gpus.manage is false", skipped=True)
    if gpu_count is None:
        return Check(name, True, HOST, "not checked: no GPU count available", skipped=True)
    need = max(gpus_needed(s) for s in specs)
    which = max(specs, key=gpus_needed).profile
    try:
        have = gpu_count()
    except GpuCountUnavailable as exc:
        return Check(name, True, HOST, f"not checked: {exc}", skipped=True)
    except Exception as exc:
        return Check(name, False, HOST, f"cannot count GPUs: {exc}")
    if have < need:
        return Check(
            name,
            False,
            HOST,
            f"{have} GPU(s) visible, profile {which} needs {need} (tp-size x pp-size)",
            "a GPU fallen off the bus or a driver reload shows in `nvidia-smi`; check gpus.devices",
        )
    return Check(name, True, HOST, f"{have} GPU(s) visible, {need} needed")


def check_caches(cfg: Config) -> Check:
    """SGLang's compile caches (supervisor/sglang/caches.py): a warning, never a failure; a lost
    cache costs compile time on the next start, not correctness. A cache another user could
    write is a failure: SGLang would run the kernels they put there."""
    owners = argv.cache_owner_problems(cfg)
    if owners:
        return Check(
            "caches",
            False,
            HOST,
            owners[0],
            "\n".join([*owners[1:], "chown the directory to the service user, chmod go-w"]),
        )
    found = argv.cache_problems(cfg)
    if not found:
        return Check(
            "caches", True, HOST, f"{cfg.warm.cache_dir}: present or creatable, persistent"
        )
    hint = "\n".join(
        [*found[1:], "set warm.cache_dir, or the sglang.env entry named (docs/systemd.md)"]
    )
    return Check("caches", True, HOST, found[0], hint, warning=True)
