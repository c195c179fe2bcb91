"""Configuration, checks across keys: the errors a combination of valid keys makes
(`_group_checks` and `_cross_checks`, run by `supervisor.config.parse`), and the likely mistakes
of a valid config that are only printed: `warnings` (by `check`) and `launch_warnings` (by
`check` and at every daemon start; re-exported by `supervisor.config`).

The token and key files' own checks (`cli.commands._token_file_problem`) are not checks of the
keys: they read the files (supervisor/secret_files.py) just before a start, so they run there.
"""

from __future__ import annotations

from supervisor import redact
from supervisor.config.convert import is_loopback, is_loopback_url
from supervisor.config.reader import _Reader
from supervisor.config.sections import tp_size
from supervisor.config.types import (
    PRIMARY,
    TP_ARGS,
    Config,
    GroupConfig,
    merged_args,
    merged_env,
)


def warnings(cfg: Config) -> list[str]:
    """Problems that do not stop the daemon but are very likely mistakes (`check` prints them)."""
    out: list[str] = []
    g = cfg.group
    if g.role != "single" and not g.peers and cfg.restart.mode != "exit":
        out.append(
            f"group: this node is the {g.role} of a multi-node replica (sglang.args.nnodes "
            f"{g.nnodes}) with neither group.peers (bare metal) nor restart.mode: exit (an "
            "orchestrator): it would relaunch alone, and a node cannot rejoin a running group"
        )
    rc = cfg.router
    if rc.url is not None:
        if is_loopback_url(rc.worker_url) and not is_loopback_url(rc.url):
            out.append(
                f"router.worker_url: {rc.worker_url} is a loopback address but the router at "
                f"{rc.url} runs on another host: it cannot reach this SGLang; set "
                "router.worker_url to an address the router can reach"
            )
        if not cfg.sglang.args.get("enable-metrics"):
            out.append(
                "router: sglang.args.enable-metrics is not set: a drain cannot see SGLang's "
                "running and queued requests and ends without waiting for them"
            )
    return out


# setproctitle, which SGLang's schedulers and detokenizer call, reuses the memory behind
# /proc/PID/environ unless this is set: their environment (our owner marker with it) then reads
# as empty (docs/sglang.md). Ownership does not depend on it (launch record, session), but
# `gpu-clean` and an operator's `ps e` read better with it.
SPT_NOENV = "SPT_NOENV"


def launch_warnings(cfg: Config) -> list[str]:
    """Things worth fixing in a valid config: one line each, naming the key."""
    out = []
    for profile in cfg.profile_names:
        for name in merged_args(cfg, profile):
            if redact.is_secret_flag(name):
                out.append(
                    f"{cfg.path}: sglang.args {name} (profile {profile}) is on SGLang's command "
                    "line, which every local user's `ps` shows: put an API key in "
                    "sglang.api_key_file instead"
                )
    for profile in cfg.profile_names:
        if merged_env(cfg, profile).get(SPT_NOENV) != "1":
            where = "sglang.env" if profile == PRIMARY else f"sglang.env / profiles.{profile}.env"
            out.append(
                f'{cfg.path}: {where} has no {SPT_NOENV}: "1" (profile {profile}): '
                "setproctitle in SGLang's schedulers and detokenizer wipes their environment, "
                "so the owner marker is unreadable there"
            )
    return out


def _group_checks(r: _Reader, g: GroupConfig) -> None:
    """The multi-node role (from sglang.args) against group.peers and group.leader."""
    if g.node_rank >= g.nnodes:
        r.error("sglang.args", f"node-rank {g.node_rank} is not below nnodes {g.nnodes}")
    if g.role == "single" and g.peers:
        r.error("group.peers", "set, but sglang.args.nnodes is not above 1")
    if g.role == "single" and g.leader:
        r.error("group.leader", "set, but sglang.args.nnodes is not above 1")
    if g.role == "follower" and len(g.peers) > 1:
        r.error("group.peers", "a follower (node-rank >= 1) lists exactly one peer: its leader")
    if g.role == "leader" and g.peers and len(g.peers) != g.nnodes - 1:
        r.error("group.peers", f"the leader lists its {g.nnodes - 1} followers; got {len(g.peers)}")


def _affects(issue: str, key: str) -> bool:
    """Whether an issue at path `issue` leaves `key` unread: the key itself, a part of it, or
    a section around it (the top level included)."""
    return (
        not issue
        or issue == key
        or issue.startswith((f"{key}.", f"{key}["))
        or key.startswith(f"{issue}.")
    )


def _cross_checks(r: _Reader, cfg: Config) -> None:
    """Checks across keys, each made only when every key it reads parsed: a key that did not
    parse reads None or its default here, which would give a wrong error, a crash, or none."""
    issues = [i.path for i in r.issues]

    def parsed(*keys: str) -> bool:
        return not any(_affects(i, k) for i in issues for k in keys)

    fb = cfg.restart.fallback_profile if parsed("restart.fallback_profile") else None
    # The profile names are known unless the profiles section, or that profile's name, was bad.
    names_known = not any(i in ("", "profiles", f"profiles.{fb}") for i in issues)
    if fb is not None and fb != PRIMARY and names_known and fb not in cfg.profiles:
        names = ", ".join(cfg.profiles) or "none defined"
        r.error(
            "restart.fallback_profile",
            f"names profile {fb!r}, which is not defined under profiles ({names})",
        )
    if fb == PRIMARY:
        r.error("restart.fallback_profile", "the fallback cannot be 'primary' itself")
    if (
        parsed("quality.on_spec_collapse", "restart.fallback_profile")
        and cfg.quality.on_spec_collapse == "fallback"
        and cfg.restart.fallback_profile is None
    ):
        r.error(
            "quality.on_spec_collapse",
            "is 'fallback' but no restart.fallback_profile is set to fall back to",
        )
    backoff = parsed("restart.backoff_max", "restart.backoff_initial")
    if backoff and cfg.restart.backoff_max < cfg.restart.backoff_initial:
        r.error("restart.backoff_max", "must be at least restart.backoff_initial")
    timing = parsed("liveness.timeout", "liveness.interval")
    if timing and cfg.liveness.timeout > cfg.liveness.interval * 10:
        r.error("liveness.timeout", "is more than ten liveness intervals; shorten it")
    listen = parsed("admin.listen")
    if (
        listen
        and parsed("sglang.host", "sglang.port")
        and (cfg.admin.host, cfg.admin.port) == (cfg.sglang.host, cfg.sglang.port)
    ):
        r.error("admin.listen", "uses the same address as SGLang's sglang.host:sglang.port")
    remote = parsed("admin.allow_remote")
    if listen and remote and not is_loopback(cfg.admin.host) and not cfg.admin.allow_remote:
        r.error(
            "admin.listen",
            f"{cfg.admin.listen} is not a loopback address: anyone who can reach it may try "
            "the token of the restart and drain endpoints; put a TLS proxy in front and set "
            "admin.allow_remote: true to serve it beyond this host (docs/security.md)",
        )
    if isinstance(cfg.gpus.devices, tuple) and parsed("gpus.devices", "sglang.args", "profiles"):
        for name in (PRIMARY, *cfg.profiles):
            own = cfg.sglang.args if name == PRIMARY else cfg.profiles[name].args
            flag = next((a for a in TP_ARGS if a in own), None)
            if flag is None:
                continue  # a profile that leaves the size alone repeats the primary's
            merged = {**cfg.sglang.args, **own}
            tp = tp_size(merged)
            if tp is not None and tp > len(cfg.gpus.devices):
                where = "sglang.args" if name == PRIMARY else f"profiles.{name}.args"
                r.error(
                    f"{where}.{flag}",
                    f"{flag} {tp} needs {tp} GPUs but gpus.devices lists {len(cfg.gpus.devices)}",
                )
