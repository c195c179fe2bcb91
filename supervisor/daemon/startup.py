"""Before anything is launched: what must hold for the daemon to start at all.

The state directory is writable, NVML answers (when `gpus.manage` is on), and preflight passes:
the configured interpreter, SGLang's own parser on the exact command lines, the model paths.
A failure here is not something a restart fixes: the daemon exits with the code preflight names
(78 for a configuration SGLang rejects: `RestartPreventExitStatus=`) instead of failing ten
minutes into a model load.
"""

from __future__ import annotations

import contextlib

from supervisor import config, log, preflight
from supervisor.config import Config
from supervisor.daemon import host
from supervisor.daemon.effects import Effects
from supervisor.daemon.observed import Observed
from supervisor.gpu.nvml import Nvml, NvmlUnavailable
from supervisor.threads import in_thread

# SGLang's parser gets 180 s of its own (a cold disk, a slow import); the rest is paths and GPUs.
PREFLIGHT_TIMEOUT_S = 240.0
VERSION_TIMEOUT_S = 60.0


class CannotStart(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def check_state_dir(cfg: Config, fx: Effects) -> None:
    """The state directory exists (made if absent) and is writable: the admin token goes
    there, before preflight. Raises CannotStart."""
    try:
        fx.store.check_writable()
    except OSError as exc:
        raise CannotStart(
            f"state directory {cfg.state_dir} is not writable: "
            f"{exc.strerror or exc} (state_dir in {cfg.path}, or StateDirectory=)"
        ) from None


async def prepare(
    cfg: Config, fx: Effects, observed: Observed, adopting: str | None = None
) -> Nvml | None:
    """The NVML handle (None when GPUs are not managed). Raises CannotStart.

    `adopting`: the SGLang version of a launch a hand-over passed on; preflight is skipped
    (SGLang holds its port, and its command line was checked before it was launched)."""
    check_state_dir(cfg, fx)
    nvml: Nvml | None = None
    if cfg.gpus.manage:
        try:
            nvml = observed.gpus.nvml = fx.open_nvml()
        except NvmlUnavailable as exc:
            raise CannotStart(
                f"GPU management is on (gpus.manage) but NVML is unavailable: {exc}"
            ) from None
        observed.gpus_known()
    if adopting is not None:
        observed.sglang(adopting)
        return nvml
    gpu_count = host.gpu_counter(nvml, cfg) if nvml is not None else None
    try:
        checks, code = await in_thread(
            lambda: preflight.startup_checks(cfg, gpu_count), PREFLIGHT_TIMEOUT_S
        )
    except TimeoutError:
        raise CannotStart(f"preflight did not finish within {PREFLIGHT_TIMEOUT_S:g}s") from None
    for check in preflight.failures(checks):
        what = {"check": check.name, "kind": check.kind, "hint": check.hint}
        log.get().error("preflight", message=check.message, **what)
    if code is not None:
        raise CannotStart(preflight.summary(checks), code)
    for warning in config.launch_warnings(cfg):  # e.g. SPT_NOENV missing (docs/sglang.md)
        log.get().warning(warning)
    version: str | None = "unknown"
    with contextlib.suppress(TimeoutError):
        version = await in_thread(lambda: preflight.sglang_version_for(cfg), VERSION_TIMEOUT_S)
    observed.sglang(version or "unknown")
    return nvml
