"""Configuration, every key declared once: its dotted name, converter, default and doc.

From this table come the known keys of each section (an unknown key is an error with a
did-you-mean), the defaults (of the parser and of the dataclasses in `types`), the conversion
and validation of each value (the converter, from `convert`), and README.md's configuration
table (`python -m supervisor.config.settings --markdown`; tests/unit/test_config_settings.py
holds the README to it). A default is written as in the YAML file (`30m`, `256MiB`) and goes
through the key's own converter, so the table shows what an operator would write.

A key whose value is a map the section parses itself (`sglang.args`, a profile's overlay) has
no converter here: its row documents it and names it as known.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from supervisor.config.convert import (
    _bool,
    _choice,
    _devices,
    _floor,
    _host,
    _http_url_list,
    _int_in,
    _linear_regex_list,
    _listen,
    _opt_absolute_path,
    _opt_env_http_url,
    _opt_http_url,
    _opt_key_file,
    _opt_readable_file,
    _opt_regex,
    _opt_string,
    _positive_duration,
    _prewarm,
    _string,
    _string_list,
    parse_duration,
    parse_size,
)

RESTART_MODES = ("relaunch", "exit")
CANARY_POLICIES = ("gate", "alert")
SPEC_COLLAPSE_ACTIONS = ("alert", "fallback")


class TrialAction(StrEnum):
    """quality.on_trial_regression: what a regressed trial does (core/upgrade_rules.py)."""

    ROLLBACK = "rollback"  # relaunch the last known good
    HOLD = "hold"  # never ready
    ALERT = "alert"  # ready, reported


TRIAL_REGRESSION_ACTIONS = tuple(a.value for a in TrialAction)
# Where the state lives without systemd's StateDirectory= ($STATE_DIRECTORY).
FALLBACK_STATE_DIR = "/var/lib/kimi-serve"

# The canary's default prompt: short, plain text any base or chat model continues confidently.
DEFAULT_CANARY_PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"

# Log lines that mean the server is broken even if its process is still up. SGLang spends ~65 s
# in py-spy / CUDA-coredump steps after a scheduler exception before it exits
# (docs/sglang.md, "Shutdown"), so reacting to the line itself saves a minute per crash.
DEFAULT_FATAL_PATTERNS: tuple[str, ...] = (
    # scheduler.py / detokenizer: `logger.error(f"Scheduler hit an exception: {traceback}")`,
    # then SIGQUIT to the parent. A bare "Traceback" is not listed: a rejected client request
    # can log one without the server being broken.
    r"(Scheduler|DetokenizerManager|TokenizerManager) hit an exception",
    r"Scheduler watchdog timeout",
    r"CUDA out of memory|torch\.OutOfMemoryError|CUDA error: out of memory",
    r"CUDA error: an illegal memory access",
    r"NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError",
    r"Initialization failed\. warmup error",
)


def _canary_prompt(value: object) -> str:
    if value is None:
        return DEFAULT_CANARY_PROMPT
    text = _string(value)
    if not text.strip():
        raise ValueError("must not be empty (null: the default prompt)")
    return text


def _trial_ratio(value: object) -> float:
    """A fraction of the last known good's reading (0 < r <= 1); 0 turns the check off."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"expected a number, got {type(value).__name__}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{value} is out of range 0-1 (a fraction of the last known good's)")
    return float(value)


def _known_answers(value: object) -> tuple[tuple[str, str], ...]:
    """[{prompt, expect}, ...] -> ((prompt, expect), ...)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValueError("expected a list of {prompt, expect}")
    out: list[tuple[str, str]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"prompt", "expect"}:
            raise ValueError(f"item {i} must be a mapping of exactly prompt and expect")
        prompt, expect = item["prompt"], item["expect"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"item {i}: prompt must be a non-empty string")
        if not isinstance(expect, str) or not expect.strip():
            raise ValueError(f"item {i}: expect must be a non-empty string")
        out.append((prompt, expect))
    return tuple(out)


REQUIRED = object()


@dataclass(frozen=True)
class Setting:
    """One config key. `default` is written as in the file and converted by `conv` (None stays
    None: the section resolves it, or it means "not set"); `shown` replaces the default in the
    docs where it is computed (from the environment, another key)."""

    key: str
    conv: Callable[[object], Any] | None
    default: object
    doc: str
    shown: str | None = None
    value: Any = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        raw = self.default
        converted = raw if raw is None or raw is REQUIRED or self.conv is None else self.conv(raw)
        object.__setattr__(self, "value", converted)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def section(self) -> str:
        return self.key.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.key.rpartition(".")[2]

    def shown_default(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.required:
            return "required"
        return f"`{_yaml(self.default)}`"


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(f'"{v}"' if isinstance(v, str) else _yaml(v) for v in value) + "]"
    return str(value)  # a number, a string, `{}`


S = Setting

SETTINGS: tuple[Setting, ...] = (
    # ---------------------------------------------------------------------------------- sglang
    S("sglang.python", _string, "/opt/sglang/venv/bin/python",
      "SGLang's interpreter; its venv stays separate from kimi-serve's"),
    S("sglang.module", _string, "sglang.launch_server", "run as `<python> -m <module> <flags>`"),
    S("sglang.model_path", _string, REQUIRED, "`--model-path`"),
    S("sglang.host", _host, "127.0.0.1", "`--host`; probes go here"),
    S("sglang.port", _int_in(1, 65535), 30000,
      "`--port`; probes go here; the port must be free before a launch"),
    S("sglang.args", None, {},
      "every other flag, name without dashes: `true` = bare flag, `false`/`null` = omitted, a "
      "list = `--name v1 v2`; `${NAME}` in a string value (also in `profiles.*.args`) is the "
      "daemon's environment variable NAME, read with the file (unset or empty: a config error "
      "naming it), so one file serves every node of a multi-node replica (`node-rank: "
      "${LWS_WORKER_INDEX}`, [docs/kubernetes.md](docs/kubernetes.md))"),
    S("sglang.env", None, {},
      "extra environment for SGLang (strings). Set `SPT_NOENV: \"1\"` (the shipped config "
      "does; `kimi-serve check` warns without it): otherwise setproctitle in SGLang's "
      "schedulers and detokenizer wipes their `/proc/PID/environ`"),
    S("sglang.workdir", _opt_string, None, "working directory of SGLang"),
    S("sglang.api_key_file", _opt_key_file, None,
      "file holding SGLang's API key (`--api-key`), one line; an absolute path; no access for "
      "others and no group write (0600, 0400 or 0440; else a config error, 78), owned by the "
      "service user or root. The key never goes on SGLang's command line (which every local "
      "user's `ps` shows): before each launch the daemon writes it to "
      "`<state_dir>/sglang-secrets.yaml` (0600) and passes `--config` with that path; every "
      "probe, canary, `/server_info` and `/metrics` request to SGLang sends `Authorization: "
      "Bearer <key>` (to SGLang's address only), as does `kimi-serve probe`. `print-command` "
      "and the logs show secret flags (`api-key`, `*token*`, `*secret*`) as `<redacted>`; "
      "`kimi-serve check` warns about an `api-key` in `sglang.args` "
      "([docs/security.md](docs/security.md))"),
    # -------------------------------------------------------------------------------- profiles
    S("profiles.NAME.args", None, None,
      "overlay on `sglang.args`; `null` removes a flag; `primary` is the base itself", "—"),
    S("profiles.NAME.env", None, None, "overlay on `sglang.env`; `null` removes a variable", "—"),
    # ------------------------------------------------------------------------------- readiness
    S("readiness.load_timeout", _positive_duration, "30m",
      "launch → first successful decode; a load takes ~10 min"),
    S("readiness.probe.endpoint", _choice("generate", "chat"), "generate",
      "`generate` (`/generate`: with speculative decoding configured, `spec_verify_ct > 0` is "
      "required) or `chat` (`/v1/chat/completions`: no per-request proof of speculation; the "
      "after-ready `/server_info` check still reports EAGLE off)"),
    S("readiness.probe.prompt", _string, "Say hello in one word", "the incident's smoke test"),
    # At least 2 tokens: one token is what /health checks and cannot see the decode loop.
    S("readiness.probe.max_tokens", _int_in(2, 4096), 8,
      "≥ 2: one token is all `/health` checks; must come back in full (or end on a stop after "
      "≥ 2)"),
    S("readiness.probe.timeout", _positive_duration, "30s",
      "total deadline of one probe, body included"),
    S("readiness.probe.expect_regex", _opt_regex, None, "optional check of the generated text"),
    # -------------------------------------------------------------------------------- liveness
    S("liveness.interval", _positive_duration, "15s", "the same probe while serving, this often"),
    S("liveness.timeout", _positive_duration, "20s",
      "the deadline of one liveness probe (at most ten intervals)"),
    S("liveness.failure_threshold", _int_in(1, 1000), 3,
      "consecutive failed probes → restart (`degraded` in between); a probe that times out "
      "while SGLang keeps working — `sglang:realtime_tokens_total` (any mode) advances by more "
      "than the probe's own tokens and prompt, with requests running or queued; "
      "`sglang:generation_tokens_total` only where the realtime counter is absent — is *busy*: "
      "it neither counts nor resets the count (a wrong answer is never busy)"),
    # --------------------------------------------------------------------------------- restart
    S("restart.backoff_initial", parse_duration, "5s",
      "the first backoff between launches, doubled on each restart, counted from the restart "
      "decision: stopping what is left of the old launch overlaps it instead of adding to the "
      "downtime"),
    S("restart.backoff_max", _positive_duration, "5m",
      "the longest backoff (at least `restart.backoff_initial`)"),
    S("restart.crash_loop.max_restarts", _int_in(1, 10000), 5,
      "that many restarts within `restart.crash_loop.window` is a crash loop"),
    S("restart.crash_loop.window", _positive_duration, "1h",
      "the window in which `max_restarts` restarts are a crash loop"),
    S("restart.fallback_profile", _opt_string, None,
      "profile to switch to on a crash loop (production: `fallback`, no speculative decoding); "
      "`null` → `failed`", "`fallback` if such a profile is defined, else `null`"),
    S("restart.stable_after", _positive_duration, "10m",
      "ready this long → the backoff starts over"),
    S("restart.mode", _choice(*RESTART_MODES), "relaunch",
      "`relaunch`: kimi-serve relaunches SGLang itself (backoff, crash loop, fallback). `exit`: "
      "where it would relaunch after a restart nobody asked for, it cleans up and exits with "
      "status **75** instead, for an orchestrator to relaunch the whole group (a node of a "
      "multi-node replica cannot rejoin; Kubernetes LeaderWorkerSet with "
      "`RecreateGroupOnPodRestart`). Requested restarts and reloads still relaunch in place "
      "([docs/kubernetes.md](docs/kubernetes.md))"),
    # ------------------------------------------------------------------------------------ stop
    S("stop.drain_timeout", _positive_duration, "60s",
      "SIGTERM, wait this long for SGLang's drain, then SIGKILL its whole group"),
    # ------------------------------------------------------------------------------------ gpus
    S("gpus.manage", _bool, True, "`false` on machines without NVML"),
    S("gpus.devices", _devices, "all", "or a list of indexes / `GPU-…` UUIDs"),
    S("gpus.leftover_policy", _choice("kill-matching", "report-only"), "kill-matching",
      "`report-only` never kills"),
    S("gpus.match", _string_list, ["sglang", "launch_server"],
      "command-line substrings of *our* leftovers (same user); anything else is foreign and "
      "never killed"),
    S("gpus.memory_free_timeout", _positive_duration, "60s",
      "wait for NVML to show the memory free; then the launch is not attempted"),
    S("gpus.memory_free_threshold_mib", _int_in(0, 10_000_000), 1024,
      "\"free\" means used memory below this on every managed GPU"),
    # ----------------------------------------------------------------------------------- admin
    S("admin.listen", _listen, "127.0.0.1:29400",
      "`/metrics` `/readyz` `/livez` `/status`, `POST /restart` `/drain` `/undrain` (9400 is "
      "dcgm-exporter's); an address that is not loopback is a config error without "
      "`admin.allow_remote`. Bound before preflight; at most 64 connections (plus 8 for "
      "loopback clients), the one waiting longest for its request head making room for a "
      "newcomer, a head whole within 10 s or the connection closed "
      "([docs/security.md](docs/security.md))"),
    S("admin.token_file", _opt_absolute_path, None,
      "bearer token for every mutating request; created by the daemon at start if absent "
      "(0600, the service user's); an existing file others could read, or another user's, "
      "stops the start with 78 (remove it: a new one is written). A symbolic link is followed "
      "only where nobody but root and the service user could have made or swapped it, so a "
      "Kubernetes Secret volume works (`defaultMode: 0400`). The state directory, not "
      "`$RUNTIME_DIRECTORY`, so the CLI finds it from the same config and the token survives "
      "restarts ([docs/security.md](docs/security.md))", "`<state_dir>/admin.token`"),
    S("admin.allow_remote", _bool, False,
      "`true` allows a non-loopback `admin.listen`; TLS is then a proxy's job, the token rules "
      "stay"),
    # ------------------------------------------------------------------------------- state_dir
    S("state_dir", _opt_string, None,
      "the launch record: (pid, create time) of SGLang and its descendants, with the boot it "
      "was written in; a record that is not the service user's own file, that group or others "
      "may write, or that another boot wrote is ignored with a warning, and it never names "
      "another user's process as ours ([docs/security.md](docs/security.md), \"Launch "
      "records\")", f"`$STATE_DIRECTORY`, else `{FALLBACK_STATE_DIR}`"),
    # ------------------------------------------------------------------------------------ logs
    S("logs.fatal_patterns", _linear_regex_list, list(DEFAULT_FATAL_PATTERNS),
      "regexes on SGLang's output that mean \"restart now\" (reason `fatal_log`), without "
      "waiting ~65 s for SGLang's own crash path; each runs on the line cut to 16 KiB, and one "
      "that can backtrack without bound (a repeat inside a repeat, an alternation inside a "
      "repeat, a backreference) is refused",
      "scheduler exception, watchdog timeout, CUDA OOM / illegal access, NCCL errors, warmup "
      "failure"),
    S("logs.tail_lines", _int_in(1, 100_000), 200, "lines kept for `last_restart.log_tail`"),
    # --------------------------------------------------------------------------------- logging
    S("logging.format", _choice("json", "console"), "json",
      "`console` for a terminal; under systemd each line carries its `<N>` priority so "
      "`journalctl -p err` works"),
    S("logging.level", _choice("debug", "info", "warning", "error"), "info",
      "`debug`, `info`, `warning` or `error`"),
    # ------------------------------------------------------------------------------- incidents
    S("incidents.dir", _opt_string, None,
      "one directory per restart nobody asked for, mode 0700 (they can hold prompts): "
      "docs/incidents.md", "`<state_dir>/incidents`"),
    S("incidents.keep", _int_in(1, 10_000), 20, "newest N kept"),
    S("incidents.dump_timeout", _positive_duration, "10s",
      "budget for py-spy stacks of a live, broken SGLang before the kill; the kill never waits "
      "longer"),
    # 20 incidents of a tp=8 server with native stacks, estimated at up to 5 MiB each
    # (docs/incidents.md): 256 MiB holds them with room, and is small beside the journal on
    # /var. 1 GiB free is what journald, package upgrades and the launch record need to keep
    # working after a burst.
    S("incidents.max_bytes", parse_size, "256MiB",
      "all incidents together; the oldest go first (20 of ~5 MiB fit with room)"),
    S("incidents.min_free_bytes", parse_size, "1GiB",
      "below this much free space only `incident.json` is written, saying what was skipped"),
    # ---------------------------------------------------------------------------------- router
    S("router.url", _opt_http_url, None,
      "the router's own HTTP API (sglang-router 0.3.x / SMG); `null`: no registration. Set: "
      "registered only while `ready` (decode-verified), taken out — confirmed by the router's "
      "list — before every stop or restart and on `degraded` ([docs/fleet.md](docs/fleet.md))"),
    S("router.worker_url", _opt_http_url, None,
      "how the router reaches this SGLang; `check` warns when it is loopback and the router is "
      "not", "`http://<sglang.host>:<sglang.port>`"),
    S("router.api_key_file", _opt_readable_file, None,
      "file holding a bearer token for the router's worker API; held to the token file's link "
      "rules, root's or the service user's, nothing for others, no group write "
      "(0600/0400/0640), else 78 at start; a warning (`check`, the log) when `router.url` is "
      "plain `http://` to another host"),
    S("router.drain_timeout", parse_duration, "30s",
      "a drain (after deregistering, or without `router.url` at once): wait at most this long "
      "for SGLang's running + queued requests to reach 0"),
    # ----------------------------------------------------------------------------------- group
    S("group.peers", _http_url_list, [],
      "a multi-node replica (`sglang.args.nnodes` > 1; the role comes from `node-rank`): the "
      "leader lists its followers' admin URLs, a follower its leader's; the group relaunches "
      "together over these endpoints ([docs/multinode.md](docs/multinode.md))"),
    S("group.leader", _opt_env_http_url, None,
      "the leader's admin URL, for one file shared by every node (a LeaderWorkerSet: "
      "`http://${LWS_LEADER_ADDRESS}:29400`): a follower's `group.peers` is set from it; the "
      "leader reads it as its own address. A leader always answers its followers' `GET "
      "/group`, with or without peers. `${NAME}` works in `group.peers` and `group.leader` as "
      "in `sglang.args`"),
    S("group.token_file", _opt_absolute_path, None,
      "the bearer token sent to the peers (the same token on every node); held to the rules of "
      "`admin.token_file` (an unsafe one stops the start with 78)", "`admin.token_file`"),
    S("group.poll_interval", _positive_duration, "0.5s",
      "how often each peer's `GET /group` is asked"),
    S("group.poll_timeout", _positive_duration, "1s", "the bound of one request to a peer"),
    S("group.partition_timeout", _positive_duration, "10s",
      "a peer unreachable this long ends this node's launch (a follower then waits for the "
      "leader; it never relaunches alone)"),
    # ------------------------------------------------------------------------------------ warm
    S("warm.cache_dir", _opt_string, None,
      "one persistent root for every JIT cache SGLang uses, set in its environment: "
      "`SGLANG_CACHE_DIR`, `SGLANG_DG_CACHE_DIR` (DeepGEMM), `SGLANG_JIT_CACHE_DIR`, "
      "`TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`, `FLASHINFER_WORKSPACE_BASE`, "
      "`CUDA_CACHE_PATH`, `TORCH_EXTENSIONS_DIR`; an `sglang.env` entry for one of them wins. "
      "`check` and `preflight` warn of a directory that is missing and not creatable, not "
      "writable, or not persistent (tmpfs, PrivateTmp, a container's own layer); "
      "`/status.last_load.caches` has each one's size before the launch "
      "([docs/systemd.md](docs/systemd.md#compile-caches))",
      "`$CACHE_DIRECTORY` (systemd's `CacheDirectory=`), else `<state_dir>/cache`"),
    S("warm.prewarm", _prewarm, "off",
      "`auto`: before each launch, from the backoff on, read the model's and the draft model's "
      "weight files into the page cache with parallel readers, skipping what is resident, "
      "within the memory bound; the launch never waits for it. Off by default: on the measured "
      "host it saved 1-3 s of a restart's weights phase and cost about as much by slowing the "
      "old launch's reap "
      "([docs/benchmarks.md](docs/benchmarks.md#restart-downtime-on-real-sglang-cpu))"),
    S("warm.prewarm_readers", _int_in(1, 64), 4, "parallel readers"),
    S("warm.prewarm_headroom", parse_size, None,
      "memory kept free: at most the available memory minus this is read, and the readers stop "
      "when it falls below this; available is the smaller of MemAvailable and what the "
      "daemon's memory cgroup leaves below its limit (`MemoryMax=`, a container's limit)",
      "10% of MemTotal (or of the cgroup's limit, if smaller), at least 2 GiB"),
    # --------------------------------------------------------------------------------- quality
    S("quality.canary.enabled", _bool, True,
      "a greedy canary generation, compared with the golden answer for the same model files "
      "and SGLang version, before the first ready of every launch and every `interval` while "
      "serving ([docs/quality.md](docs/quality.md))"),
    S("quality.canary.prompt", _canary_prompt, DEFAULT_CANARY_PROMPT,
      "the canary's prompt; `null`: a fixed pangram prompt. Choose one the model continues "
      "confidently (`kimi-serve canary show` says how many tokens are compared)", "`null`"),
    # At least 2: one token is a prefill, not a decode.
    S("quality.canary.max_tokens", _int_in(2, 256), 16, "tokens generated (2-256)"),
    S("quality.canary.policy", _choice(*CANARY_POLICIES), "gate",
      "`gate`: a launch whose canary differs is never ready (restart reason `canary_mismatch`, "
      "counted towards the crash loop, so the fallback profile is tried), nor one whose canary "
      "gets no answer 3 times (`canary_unavailable`); `alert`: ready, the mismatch reported"),
    S("quality.canary.interval", _positive_duration, "10m",
      "while serving, the first liveness probe after this long carries the canary (never a "
      "second probe in flight); a mismatch then is reported, never a restart"),
    S("quality.known_answers", _known_answers, [],
      "prompts whose greedy answer must begin with `expect` (whitespace before either "
      "ignored), `[{prompt, expect}]`: asked at every launch of a new golden key (another "
      "SGLang version, other model files), so a first launch's answer is never trusted "
      "unchecked; one that fails is `canary_mismatch`. `kimi-serve canary try` shows what "
      "the running model answers ([docs/quality.md](docs/quality.md))"),
    S("quality.spec_accept_floor", _floor, 1.3,
      "with speculative decoding configured: a mean accept length (SGLang's "
      "`sglang:spec_accept_length`, else the probes') below it is `spec_collapse`"),
    S("quality.on_spec_collapse", _choice(*SPEC_COLLAPSE_ACTIONS), "alert",
      "`alert`: reported only; `fallback`: relaunched on `restart.fallback_profile` (reason "
      "`spec_collapse`, an incident); back on the primary on a reload"),
    S("quality.trial_period", _positive_duration, "10m",
      "a launch that passed its checks and served this long becomes the last known good "
      "(`<state_dir>/upgrade/lkg.json`); a launch that differs from it (interpreter, SGLang "
      "version, model files, argv, env) is a trial "
      "([docs/quality.md](docs/quality.md#trials-and-the-last-known-good))"),
    S("quality.trial_slowdown", _trial_ratio, 0.8,
      "a trial whose single-stream decode tokens/s at the gate (idle, the fixed prompts) is "
      "below this x the last known good's, measured the same way, regressed; 0: not judged"),
    S("quality.trial_accept_drop", _trial_ratio, 0.8,
      "with speculative decoding: a trial whose accept length at the gate is below this x "
      "the last known good's regressed; 0: not judged"),
    S("quality.on_trial_regression", _choice(*TRIAL_REGRESSION_ACTIONS), "rollback",
      "`rollback`: relaunch the last known good (reason `trial_regressed`, an incident, alert "
      "`KimiServeRolledBack`; with no verifiable last known good a wrong answer is "
      "`canary_mismatch` and a slower trial serves, `regressed`); `hold`: never ready "
      "(`failed`, SGLang stopped, until an operator decides); `alert`: ready, the regression "
      "reported"),
)  # fmt: skip

BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


def setting(key: str) -> Setting:
    return BY_KEY[key]


def default(key: str) -> Any:
    """The typed default of `key` (None where the section resolves it)."""
    return BY_KEY[key].value


def known(section: str) -> tuple[str, ...]:
    """The keys a section may hold, in the order declared ("" is the top level)."""
    prefix = f"{section}." if section else ""
    names = (s.key.removeprefix(prefix).split(".")[0] for s in SETTINGS if s.key.startswith(prefix))
    return tuple(dict.fromkeys(names))


def leaves(section: str) -> tuple[Setting, ...]:
    """The settings directly in `section` that have a converter (not its subsections)."""
    return tuple(s for s in SETTINGS if s.section == section and s.conv is not None)


TABLE_HEADER = "| key | default | meaning, and why |\n|---|---|---|"


def markdown() -> str:
    """README.md's configuration table, one row per key."""
    rows = (f"| `{s.key}` | {s.shown_default()} | {s.doc} |" for s in SETTINGS)
    return "\n".join((TABLE_HEADER, *rows))


def main(argv: Sequence[str] | None = None) -> int:
    if list(sys.argv[1:] if argv is None else argv) != ["--markdown"]:
        print("usage: python -m supervisor.config.settings --markdown", file=sys.stderr)
        return 2
    print(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
