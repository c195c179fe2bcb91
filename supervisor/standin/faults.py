"""The stand-in's knobs: timings and fault injection, read once from the environment.

Every variable is optional; docs/standin.md lists them with what each fault imitates. A
misspelt fault name is an error (exit 2), never silently "no fault": a test that meant to
inject one must not pass by accident.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
from collections.abc import Mapping
from typing import TypeVar

_N = TypeVar("_N", int, float)

SEED_INCIDENT = "seed-incident"
DECODE_500 = "decode-500"
DECODE_ZERO_TOKENS = "decode-zero-tokens"
DECODE_HANG = "decode-hang"
EXIT_AFTER = "exit-after"
CRASH_DURING_LOAD = "crash-during-load"
NEVER_READY = "never-ready"
ORPHANS = "orphans"
IGNORE_SIGTERM = "ignore-sigterm"
SLOW_DECODE = "slow-decode"
LOG_FLOOD = "log-flood"
# What a CPU cannot show of real SGLang (docs/quality.md): speculation that accepts nothing
# (every verify step lands only its bonus token: accept length 1.0), decode batches that run
# without CUDA graphs (`cuda graph: False`), and a canary answer of different tokens.
SPEC_COLLAPSE = "spec-collapse"
NO_CUDA_GRAPH = "no-cuda-graph"
WRONG_ANSWER = "wrong-answer"

FAULTS = (
    SEED_INCIDENT,
    DECODE_500,
    DECODE_ZERO_TOKENS,
    DECODE_HANG,
    EXIT_AFTER,
    CRASH_DURING_LOAD,
    NEVER_READY,
    ORPHANS,
    IGNORE_SIGTERM,
    SLOW_DECODE,
    LOG_FLOOD,
    SPEC_COLLAPSE,
    NO_CUDA_GRAPH,
    WRONG_ANSWER,
)


class SettingsError(ValueError):
    """A variable has a value the stand-in cannot use; the message names it."""


@dataclasses.dataclass(frozen=True)
class Settings:
    load_seconds: float = 2.0
    # SGLang's warmup thread sleeps 1 s before its first request (http_server.py,
    # _execute_server_warmup), so /health answers 503 for at least that long after the bind.
    warmup_seconds: float = 1.0
    faults: frozenset[str] = frozenset()
    launch: int = 1
    exit_after: float = 5.0
    exit_code: int = 1
    seconds_per_token: float = 0.002
    slow_decode_seconds: float = 60.0
    slow_after_decodes: int = 0
    flood_lines: int = 200_000
    flood_only: bool = False
    # SGLang's crash path (py-spy dump, CUDA coredump) takes about 65 s before the exit.
    crash_sleep_seconds: float = 65.0
    orphan_lifetime: float = 600.0
    # The readiness probe and the canary that rides it answer; every later decode hangs.
    hang_after_decodes: int = 2
    hang_min_tokens: int = 0  # decode-hang spares shorter requests (an 8-token probe)
    # SGLang's own variables, honoured with SGLang's defaults (http_server.py,
    # tokenizer_manager.py sigterm_watchdog).
    health_check_timeout: float = 20.0
    force_shutdown: bool = False
    # sglang/srt/managers/scheduler.py:6376: a scheduler exception SIGKILLs the process group.
    killpg_on_scheduler_exception: bool = False
    # Not SGLang's: a file the stand-in appends one JSON line to per /generate request *on
    # arrival* (time, prompt), so a test can count what reached a replica, hung ones included.
    request_log: str | None = None
    # Not SGLang's: the version /server_info reports (another SGLang release, for the
    # canary's verified relearning); empty: the stand-in's own.
    version: str = ""

    def has(self, fault: str) -> bool:
        return fault in self.faults


def _number(env: Mapping[str, str], name: str, kind: type[_N], default: _N) -> _N:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a {kind.__name__}") from None
    if value < 0:
        raise SettingsError(f"{name}={raw!r} must not be negative")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parse_faults(raw: str) -> frozenset[str]:
    names = frozenset(part.strip() for part in raw.split(",") if part.strip())
    unknown = sorted(names - set(FAULTS))
    if unknown:
        raise SettingsError(
            f"STANDIN_FAULT names unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}"
        )
    return names


def from_environ(env: Mapping[str, str], launch: int) -> Settings:
    """Read the settings for launch number `launch` (1-based)."""
    faults = parse_faults(env.get("STANDIN_FAULT", ""))
    only_on = env.get("STANDIN_FAULT_LAUNCH", "").strip()
    if only_on and _number(env, "STANDIN_FAULT_LAUNCH", int, 0) != launch:
        faults = frozenset()
    d = Settings()
    return Settings(
        load_seconds=_number(env, "STANDIN_LOAD_SECONDS", float, d.load_seconds),
        warmup_seconds=_number(env, "STANDIN_WARMUP_SECONDS", float, d.warmup_seconds),
        faults=faults,
        launch=launch,
        exit_after=_number(env, "STANDIN_EXIT_AFTER", float, d.exit_after),
        exit_code=_number(env, "STANDIN_EXIT_CODE", int, d.exit_code),
        seconds_per_token=_number(
            env, "STANDIN_DECODE_SECONDS_PER_TOKEN", float, d.seconds_per_token
        ),
        slow_after_decodes=_number(env, "STANDIN_SLOW_AFTER_DECODES", int, d.slow_after_decodes),
        slow_decode_seconds=_number(
            env, "STANDIN_SLOW_DECODE_SECONDS", float, d.slow_decode_seconds
        ),
        flood_lines=_number(env, "STANDIN_FLOOD_LINES", int, d.flood_lines),
        flood_only=_flag(env, "STANDIN_FLOOD_ONLY"),
        crash_sleep_seconds=_number(
            env, "STANDIN_CRASH_SLEEP_SECONDS", float, d.crash_sleep_seconds
        ),
        orphan_lifetime=_number(env, "STANDIN_ORPHAN_LIFETIME", float, d.orphan_lifetime),
        hang_after_decodes=_number(env, "STANDIN_HANG_AFTER_DECODES", int, d.hang_after_decodes),
        hang_min_tokens=_number(env, "STANDIN_HANG_MIN_TOKENS", int, d.hang_min_tokens),
        health_check_timeout=_number(
            env, "SGLANG_HEALTH_CHECK_TIMEOUT", float, d.health_check_timeout
        ),
        force_shutdown=_flag(env, "SGL_FORCE_SHUTDOWN"),
        killpg_on_scheduler_exception=_flag(env, "SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION"),
        request_log=env.get("STANDIN_REQUEST_LOG") or None,
        version=env.get("STANDIN_SGLANG_VERSION", "").strip(),
    )


def next_launch(counter_path: str | None) -> int:
    """Count this launch in the shared counter file and return its 1-based number.

    The file is locked while it is read and rewritten, so launches racing each other (a
    supervisor restarting quickly) still get distinct numbers. No file: every launch is 1.
    """
    if not counter_path:
        return 1
    fd = os.open(counter_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.read(fd, 64).decode("ascii", "replace").strip()
        try:
            launch = int(raw) + 1 if raw else 1
        except ValueError:
            raise SettingsError(
                f"STANDIN_LAUNCH_COUNTER file {counter_path} holds {raw!r}, not an integer"
            ) from None
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, f"{launch}\n".encode("ascii"))
        return launch
    finally:
        os.close(fd)  # closing releases the lock
