"""SIGHUP: read the config file again and judge it against the running one.

Reading happens off the loop, in a daemon thread under a deadline (`threads.in_thread`): a hung
mount must not stall supervision. The new file goes through preflight's config checks, SGLang's
own parser included, so a flag the installed SGLang rejects is refused here instead of trading
the running server for a crash loop. The machine decides what the verdict means
(`machine.ConfigRead`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from supervisor import config as config_mod
from supervisor import log, preflight
from supervisor.config import Config, ConfigError, ConfigIssue
from supervisor.core.machine import Verdict
from supervisor.daemon import group
from supervisor.threads import in_thread

RELOAD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Read:
    """The reloaded file as read, judged on the loop against the running configuration."""

    config: Config | ConfigError


def _read(path: str) -> Config:
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ConfigError(path, [ConfigIssue("", None, "is not a regular file")])
    new = config_mod.load(path)
    checks = preflight.run_checks(new)
    problems = preflight.failures(checks, preflight.CONFIG)
    if problems:
        # Each problem whole, its hint and the key and line it came from included: the log line
        # is all an operator gets for a refused reload (STATUS= has the one-line summary).
        raise ConfigError(path, [ConfigIssue("", None, c.one_line()) for c in problems])
    return new


async def read(path: str, timeout: float = RELOAD_TIMEOUT_S) -> Config | ConfigError:
    """The new configuration, or why it cannot be used (never raises)."""
    try:
        return await in_thread(lambda: _read(path), timeout)
    except ConfigError as exc:
        return exc
    except (OSError, TimeoutError) as exc:
        reason = str(exc) or f"no answer within {timeout:g}s (hung mount?)"
        return ConfigError(path, [ConfigIssue("", None, f"cannot read: {reason}")])


def _comparable(cfg: Config) -> Any:
    return replace(cfg, path="")


def router_only(running: Config, new: Config) -> bool:
    """Only the `router:` section differs: nothing SGLang runs with changed."""
    return new.router != running.router and _comparable(replace(new, router=running.router)) == (
        _comparable(running)
    )


def judge(
    running: Config,
    new: Config | ConfigError,
    refused: Callable[[str | None], None] = lambda _: None,
) -> Verdict:
    """Invalid, unchanged or changed; logs why. The caller takes every valid config (a changed
    one restarts SGLang). A change of the `router:` section alone is `UNCHANGED` to the
    machine, which has nothing to restart for it; the daemon's router link applies it
    (`router.relink`: another router or worker URL is left and joined, drain_timeout and
    api_key_file apply at once). `refused` hears why a valid file was refused (None once one
    is taken): /status."""
    logger = log.get()
    if isinstance(new, ConfigError):
        logger.error(
            "reload refused: keeping the running configuration",
            errors=new.render().splitlines(),
        )
        return Verdict.INVALID
    problem = group.reload_refusal(running, new)
    if problem is not None:
        problem += "; it applies at the next start of the daemon (restart every node of the group)"
        logger.error("reload refused: keeping the running configuration", why=problem)
        refused(problem)
        return Verdict.INVALID
    refused(None)
    if _comparable(new) == _comparable(running):
        logger.info("reload: configuration unchanged")
        return Verdict.UNCHANGED
    if router_only(running, new):
        logger.info("reload: only the router section changed; SGLang keeps running")
        return Verdict.UNCHANGED
    if (new.admin, new.state_dir, new.logging) != (
        running.admin,
        running.state_dir,
        running.logging,
    ):
        logger.warning("reload: admin.listen, state_dir and logging apply at next start")
    logger.info("reload: configuration changed, restarting SGLang")
    return Verdict.CHANGED
