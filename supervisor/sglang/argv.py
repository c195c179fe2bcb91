"""Config + profile -> the exact SGLang command line and environment. Pure: no I/O."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from supervisor import redact
from supervisor.config import PRIMARY, ArgValue, Config, merged_args, merged_env, tp_size
from supervisor.sglang import caches


@dataclass(frozen=True)
class LaunchSpec:
    profile: str
    argv: tuple[str, ...]
    env: Mapping[str, str]  # additions to the daemon's own environment
    args: Mapping[str, ArgValue]  # the merged flag map the argv was built from

    @property
    def tp_size(self) -> int:
        return tp_size(self.args) or 1

    @property
    def speculative(self) -> bool:
        """Whether a speculative algorithm is configured (then the probe wants spec_verify_ct)."""
        algo = self.args.get("speculative-algorithm")
        return algo not in (None, False, "", "NONE", "none")

    def shell(self) -> str:
        """The command line to show or log: secret flags' values as <redacted>."""
        return shlex.join(redact.argv(self.argv))

    def env_lines(self) -> list[str]:
        """The environment to show: a secret's value (HF_TOKEN, ...) as <redacted>."""
        return [
            f"{k}={redact.REDACTED if redact.is_secret_flag(k) else shlex.quote(v)}"
            for k, v in sorted(self.env.items())
        ]


def _format(value: str | int | float) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def flag_tokens(name: str, value: ArgValue) -> list[str]:
    """One config entry -> argv tokens: true is a bare flag, false/null are omitted, and a list
    gives `--name v1 v2` (SGLang's list flags use nargs="+")."""
    if value is None or value is False:
        return []
    if value is True:
        return [f"--{name}"]
    if isinstance(value, tuple):
        items = (v for v in value if v is not None and not isinstance(v, bool))
        return [f"--{name}", *(_format(v) for v in items)]
    return [f"--{name}", _format(value)]


def build(cfg: Config, profile: str = PRIMARY) -> LaunchSpec:
    """The argv `<python> -m <module> --model-path M --host H --port P <args...>` and env."""
    if profile not in cfg.profile_names:
        raise KeyError(f"unknown profile {profile!r}; defined: {', '.join(cfg.profile_names)}")
    args = merged_args(cfg, profile)
    argv = [
        cfg.sglang.python,
        "-m",
        cfg.sglang.module,
        "--model-path",
        cfg.sglang.model_path,
        "--host",
        cfg.sglang.host,
        "--port",
        str(cfg.sglang.port),
    ]
    for name, value in args.items():
        argv.extend(flag_tokens(name, value))
    if cfg.sglang.api_key_file:
        # The key itself stays off the command line (every local user's `ps` shows it):
        # SGLang reads it from this file, which the launcher writes (supervisor/sglang/api_key.py).
        argv.extend(["--config", secrets_path(cfg.state_dir)])
    return LaunchSpec(
        profile=profile,
        argv=tuple(argv),
        # Every JIT cache under warm.cache_dir, unless sglang.env names its own (caches.py).
        env={**caches.env(cfg.warm.cache_dir), **merged_env(cfg, profile)},
        args={k: v for k, v in args.items() if v is not None and v is not False},
    )


SECRETS_FILE = "sglang-secrets.yaml"


def secrets_path(state_dir: str) -> str:
    """Where the launcher puts SGLang's API key for `--config` (mode 0600)."""
    return str(Path(state_dir) / SECRETS_FILE)


def cache_problems(cfg: Config) -> list[str]:
    """The problems of every profile's cache directories, each once (`check`, `preflight`)."""
    return caches.problems(_cache_dirs(cfg), caches.read_mounts())


def cache_owner_problems(cfg: Config) -> list[str]:
    """Cache directories (of every profile, and warm.cache_dir itself) another user could
    write: refused by `check`, `preflight` and the daemon (caches.owner_problem)."""
    uids, gids = caches.trusted_owners(cfg.state_dir)
    dirs = {"warm.cache_dir": cfg.warm.cache_dir, **_cache_dirs(cfg)}
    return caches.owner_problems(dirs, uids, gids)


def _cache_dirs(cfg: Config) -> dict[str, str]:
    dirs: dict[str, str] = {}
    for profile in cfg.profile_names:
        for name, path in caches.paths(build(cfg, profile).env).items():
            if path not in dirs.values():
                dirs[name if name not in dirs else f"{name} ({profile})"] = path
    return dirs
