"""Configuration: one YAML file parsed once into frozen, typed objects.

Every problem is collected (not just the first), and each names the file, the key path and the
line, so an operator fixes a broken config in one pass. Nothing after `load()` reads raw dicts.

Every key is declared once, in `settings` (converter, default, doc); the rest derives from it.
The pieces: the declarations (`settings`), the errors (`errors`), the value converters and
`${VAR}` expansion (`convert`), the YAML reader (`reader`), the typed result (`types`), one
parser per section (`sections`) and the checks across keys and the warnings (`checks`); what
other modules use is importable from here. This module reads the file and puts them together
(`load`, `parse`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import yaml

from supervisor.config import settings
from supervisor.config.checks import _cross_checks, _group_checks
from supervisor.config.checks import launch_warnings as launch_warnings
from supervisor.config.checks import warnings as warnings
from supervisor.config.convert import is_loopback as is_loopback
from supervisor.config.convert import is_loopback_url as is_loopback_url
from supervisor.config.convert import key_file_problem as key_file_problem
from supervisor.config.convert import parse_duration as parse_duration
from supervisor.config.convert import parse_listen as parse_listen
from supervisor.config.convert import parse_size as parse_size
from supervisor.config.reader import _alias_issues, _marks, _Reader, _yaml_issue
from supervisor.config.sections import (
    _admin,
    _gpus,
    _group,
    _incidents,
    _liveness,
    _logging,
    _logs,
    _open,
    _profiles,
    _quality,
    _readiness,
    _restart,
    _router,
    _sglang,
    _stop,
    _values,
    _warm,
)
from supervisor.config.sections import default_cache_dir as default_cache_dir
from supervisor.config.sections import default_state_dir as default_state_dir
from supervisor.config.sections import default_token_file as default_token_file
from supervisor.config.sections import tp_size as tp_size
from supervisor.config.types import CANARY_POLICIES as CANARY_POLICIES
from supervisor.config.types import DEFAULT_CANARY_PROMPT as DEFAULT_CANARY_PROMPT
from supervisor.config.types import DEFAULT_FATAL_PATTERNS as DEFAULT_FATAL_PATTERNS
from supervisor.config.types import INCIDENTS_MAX_BYTES as INCIDENTS_MAX_BYTES
from supervisor.config.types import INCIDENTS_MIN_FREE as INCIDENTS_MIN_FREE
from supervisor.config.types import PRIMARY as PRIMARY
from supervisor.config.types import RESERVED_ARGS as RESERVED_ARGS
from supervisor.config.types import RESTART_MODES as RESTART_MODES
from supervisor.config.types import SPEC_COLLAPSE_ACTIONS as SPEC_COLLAPSE_ACTIONS
from supervisor.config.types import TP_ARGS as TP_ARGS
from supervisor.config.types import AdminConfig as AdminConfig
from supervisor.config.types import ArgScalar as ArgScalar
from supervisor.config.types import ArgValue as ArgValue
from supervisor.config.types import CanaryConfig as CanaryConfig
from supervisor.config.types import Config as Config
from supervisor.config.types import ConfigError as ConfigError
from supervisor.config.types import ConfigIssue as ConfigIssue
from supervisor.config.types import CrashLoopConfig as CrashLoopConfig
from supervisor.config.types import GpusConfig as GpusConfig
from supervisor.config.types import GroupConfig as GroupConfig
from supervisor.config.types import IncidentsConfig as IncidentsConfig
from supervisor.config.types import LivenessConfig as LivenessConfig
from supervisor.config.types import LoggingConfig as LoggingConfig
from supervisor.config.types import LogsConfig as LogsConfig
from supervisor.config.types import ProbeConfig as ProbeConfig
from supervisor.config.types import Profile as Profile
from supervisor.config.types import QualityConfig as QualityConfig
from supervisor.config.types import ReadinessConfig as ReadinessConfig
from supervisor.config.types import RestartConfig as RestartConfig
from supervisor.config.types import RouterConfig as RouterConfig
from supervisor.config.types import SGLangConfig as SGLangConfig
from supervisor.config.types import StopConfig as StopConfig
from supervisor.config.types import WarmConfig as WarmConfig
from supervisor.config.types import merged_args as merged_args
from supervisor.config.types import merged_env as merged_env

DEFAULT_CONFIG_PATH = "/etc/kimi-serve/kimi-serve.yaml"
CONFIG_ENV = "KIMI_SERVE_CONFIG"


TOP_KEYS = settings.known("")


def parse(text: str, file: str) -> Config:
    """Parse YAML text into a Config, or raise ConfigError listing every problem."""
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            # Before anything is built or walked: an alias bomb is refused in linear time.
            bombs = _alias_issues(node, len(text))
            if bombs:
                raise ConfigError(file, bombs)
            raw = None if node is None else loader.construct_document(node)
        finally:
            loader.dispose()
        marks, twice = _marks(node)
    except yaml.YAMLError as exc:
        raise ConfigError(file, [_yaml_issue(exc, text)]) from None
    except RecursionError:
        raise ConfigError(
            file, [ConfigIssue("", None, "invalid YAML: nested too deeply")]
        ) from None
    r = _Reader(file, marks)
    r.issues.extend(twice)
    if raw is None:
        raise ConfigError(file, [ConfigIssue("", None, "the file is empty")])
    top = _open(r, raw, "")
    if not isinstance(raw, dict):
        raise ConfigError(file, r.issues)
    state_dir = _values(r, top, "")["state_dir"] or default_state_dir()
    sglang = _sglang(r, top.get("sglang"))
    cfg = Config(
        path=file,
        sglang=sglang,
        profiles=_profiles(r, top.get("profiles")),
        readiness=_readiness(r, top.get("readiness")),
        liveness=_liveness(r, top.get("liveness")),
        restart=_restart(r, top.get("restart")),
        stop=_stop(r, top.get("stop")),
        gpus=_gpus(r, top.get("gpus")),
        admin=_admin(r, top.get("admin"), state_dir),
        state_dir=state_dir,
        logs=_logs(r, top.get("logs")),
        logging=_logging(r, top.get("logging")),
        incidents=_incidents(r, top.get("incidents"), state_dir),
        router=_router(r, top.get("router"), sglang),
        warm=_warm(r, top.get("warm"), state_dir),
        quality=_quality(r, top.get("quality")),
        key_lines=marks,
    )
    cfg = replace(cfg, group=_group(r, top.get("group"), cfg))
    _group_checks(r, cfg.group)
    restart_raw = top.get("restart")
    if (
        not (isinstance(restart_raw, dict) and "fallback_profile" in restart_raw)
        and "fallback" in cfg.profiles
    ):
        # Unset: a profile named `fallback` is the fallback (the contract's example); without
        # one a crash loop ends in `failed`. An explicit null always means `failed`.
        cfg = replace(cfg, restart=replace(cfg.restart, fallback_profile="fallback"))
    _cross_checks(r, cfg)
    if r.issues:
        raise ConfigError(file, r.issues)
    return cfg


def resolve_path(cli_value: str | None) -> str:
    return cli_value or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH


def load(path: str) -> Config:
    """Read and parse the config file; every failure is a ConfigError naming the file."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        hint = f" (set --config or ${CONFIG_ENV})" if path == DEFAULT_CONFIG_PATH else ""
        raise ConfigError(path, [ConfigIssue("", None, f"no such file{hint}")]) from None
    except IsADirectoryError:
        raise ConfigError(path, [ConfigIssue("", None, "is a directory, not a file")]) from None
    except PermissionError:
        raise ConfigError(
            path, [ConfigIssue("", None, "permission denied: the daemon cannot read it")]
        ) from None
    except OSError as exc:
        raise ConfigError(path, [ConfigIssue("", None, f"cannot read: {exc.strerror}")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        issue = ConfigIssue("", line, f"not UTF-8 text: byte {data[exc.start]:#04x} ({exc.reason})")
        raise ConfigError(path, [issue]) from None
    return parse(text, path)
