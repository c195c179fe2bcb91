"""supervisor.config: the malformed-config corpus, defaults, durations and file errors.

Every file under configs/bad/ starts with one `# expect: <key path> | <text> | <line>` comment
per problem it contains (`-` for no line, an empty key path for whole-file problems). Each file
is checked twice: in-process against the exact issue list, and through the CLI in a separate
interpreter (a subset through the installed console script itself), which must exit 78 naming
the file, key path and line, and never print a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from supervisor import config
from supervisor.config import ConfigError, parse_duration, parse_listen

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = REPO / "etc" / "kimi-serve.yaml"
BAD_DIR = Path(__file__).resolve().parent / "configs" / "bad"
BAD_FILES = sorted(BAD_DIR.glob("*.yaml"))
KIMI_SERVE = Path(sys.executable).with_name("kimi-serve")
EX_CONFIG = 78


@dataclasses.dataclass(frozen=True)
class Expect:
    path: str
    text: str
    line: int | None


def expectations(file: Path) -> list[Expect]:
    """The `# expect:` header of a corpus file (ASCII, so a file that is not UTF-8 has one)."""
    out = []
    for raw in file.read_bytes().split(b"\n"):
        line = raw.decode("ascii")
        if not line.startswith("# expect:"):
            break
        path, text, where = (part.strip() for part in line.removeprefix("# expect:").split("|"))
        out.append(Expect(path, text, None if where == "-" else int(where)))
    assert out, f"{file.name}: the first line must be `# expect: <key path> | <text> | <line>`"
    return out


def cli_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (config.CONFIG_ENV, "KIMI_SERVE_DEBUG", "NOTIFY_SOCKET")
    }
    return env | extra


def kimi_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert KIMI_SERVE.exists(), f"console script {KIMI_SERVE} missing: pip install -e '.[test]'"
    return subprocess.run(
        [str(KIMI_SERVE), *args],
        capture_output=True,
        text=True,
        env=cli_env() if env is None else env,
        timeout=60,
        cwd=REPO,
    )


def assert_config_failure(done: subprocess.CompletedProcess[str], file: str) -> None:
    assert done.returncode == EX_CONFIG, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert done.stdout == ""
    assert file in done.stderr


# --------------------------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------------------------


def test_corpus_is_large_enough() -> None:
    assert len(BAD_FILES) >= 25
    assert sum(len(expectations(f)) > 1 for f in BAD_FILES) >= 1, "no multi-error file"


@pytest.mark.parametrize("file", BAD_FILES, ids=lambda f: f.stem)
def test_bad_config_reports_exactly_the_expected_issues(file: Path) -> None:
    expected = expectations(file)
    with pytest.raises(ConfigError) as info:
        config.load(str(file))
    issues = info.value.issues
    assert info.value.file == str(file)
    assert len(issues) == len(expected), info.value.render()
    for want in expected:
        assert any(
            i.path == want.path and i.line == want.line and want.text in i.message for i in issues
        ), f"no issue {want} in:\n{info.value.render()}"


# One interpreter runs `kimi-serve check` on every corpus file through cli.main, exactly as the
# console script does (`sys.exit(main())`); an exception escaping main shows up as a traceback in
# that file's stderr. Starting one interpreter per file would cost ~0.1 s each.
_DRIVER = """
import contextlib, io, json, sys, traceback
from supervisor.cli import main
results = {}
for file in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["check", "--config", file])
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = None
    results[file] = [code, out.getvalue(), err.getvalue()]
json.dump(results, sys.stdout)
"""


@pytest.fixture(scope="module")
def corpus_runs() -> dict[str, subprocess.CompletedProcess[str]]:
    files = [str(f) for f in BAD_FILES]
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, *files],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    return {
        f: subprocess.CompletedProcess(["check", f], code, out, err)
        for f, (code, out, err) in results.items()
    }


def assert_names_file_key_and_line(done: subprocess.CompletedProcess[str], file: Path) -> None:
    assert_config_failure(done, str(file))
    lines = done.stderr.splitlines()
    expected = expectations(file)
    assert len(lines) == len(expected), done.stderr
    for want in expected:
        where = f"{file}:{want.line}" if want.line else str(file)
        prefix = f"{where}: {want.path}: " if want.path else f"{where}: "
        assert any(ln.startswith(prefix) and want.text in ln for ln in lines), (
            f"no line starting {prefix!r} containing {want.text!r}:\n{done.stderr}"
        )


@pytest.mark.parametrize("file", BAD_FILES, ids=lambda f: f.stem)
def test_check_exits_78_naming_file_key_and_line(
    file: Path, corpus_runs: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    assert_names_file_key_and_line(corpus_runs[str(file)], file)


# A representative subset through the real console script, one process each.
CONSOLE_SUBSET = [
    "yaml-unclosed-quote",
    "not-utf8",
    "top-level-list",
    "empty",
    "unknown-top-level-key",
    "port-not-a-number",
    "duration-huge",
    "missing-sglang",
    "args-recursive-alias",
    "tp-size-over-devices",
    "multiple-errors",
    "cross-checks-beside-other-errors",
]


@pytest.mark.parametrize("name", CONSOLE_SUBSET)
def test_console_script_exits_78_naming_file_key_and_line(name: str) -> None:
    file = BAD_DIR / f"{name}.yaml"
    assert_names_file_key_and_line(kimi_serve("check", "--config", str(file)), file)


# --------------------------------------------------------------------------------------------
# Files that cannot be read at all
# --------------------------------------------------------------------------------------------


def test_missing_file_exits_78_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    done = kimi_serve("check", "--config", str(missing))
    assert_config_failure(done, str(missing))
    assert "no such file" in done.stderr


def test_directory_exits_78(tmp_path: Path) -> None:
    done = kimi_serve("check", "--config", str(tmp_path))
    assert_config_failure(done, str(tmp_path))
    assert "is a directory" in done.stderr


def test_path_through_a_file_exits_78(tmp_path: Path) -> None:
    file = tmp_path / "plain"
    file.write_text("x")
    target = file / "kimi-serve.yaml"
    done = kimi_serve("check", "--config", str(target))
    assert_config_failure(done, str(target))
    assert "cannot read" in done.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_unreadable_file_exits_78(tmp_path: Path) -> None:
    file = tmp_path / "kimi-serve.yaml"
    file.write_text(PRODUCTION.read_text())
    file.chmod(0)
    done = kimi_serve("check", "--config", str(file))
    assert_config_failure(done, str(file))
    assert "permission denied" in done.stderr


def test_default_path_missing_hints_at_config_and_env() -> None:
    if Path(config.DEFAULT_CONFIG_PATH).exists():
        pytest.skip(f"{config.DEFAULT_CONFIG_PATH} exists on this machine")
    done = kimi_serve("check")
    assert_config_failure(done, config.DEFAULT_CONFIG_PATH)
    assert f"--config or ${config.CONFIG_ENV}" in done.stderr


# --------------------------------------------------------------------------------------------
# Choosing the file: --config over $KIMI_SERVE_CONFIG over the default
# --------------------------------------------------------------------------------------------


def test_production_config_checks_ok() -> None:
    done = kimi_serve("check", "--config", str(PRODUCTION))
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")


def test_env_var_selects_the_file() -> None:
    bad = BAD_DIR / "port-zero.yaml"
    done = kimi_serve("check", env=cli_env(KIMI_SERVE_CONFIG=str(bad)))
    assert_config_failure(done, str(bad))
    done = kimi_serve("check", env=cli_env(KIMI_SERVE_CONFIG=str(PRODUCTION)))
    assert (done.returncode, done.stdout) == (0, "ok\n")


def test_config_flag_overrides_env_var() -> None:
    bad = BAD_DIR / "port-zero.yaml"
    env = cli_env(KIMI_SERVE_CONFIG=str(bad))
    done = kimi_serve("check", "--config", str(PRODUCTION), env=env)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")


def test_resolve_path_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(config.CONFIG_ENV, raising=False)
    assert config.resolve_path(None) == config.DEFAULT_CONFIG_PATH
    monkeypatch.setenv(config.CONFIG_ENV, "/from/env.yaml")
    assert config.resolve_path(None) == "/from/env.yaml"
    assert config.resolve_path("/from/flag.yaml") == "/from/flag.yaml"


# --------------------------------------------------------------------------------------------
# Good configs parse into the typed objects
# --------------------------------------------------------------------------------------------


def test_production_config_values() -> None:
    cfg = config.load(str(PRODUCTION))
    assert cfg.path == str(PRODUCTION)
    assert (cfg.sglang.host, cfg.sglang.port) == ("127.0.0.1", 30000)
    assert cfg.sglang.model_path == "/shared/kimi-k2.5-int4"
    assert cfg.sglang.args["tp-size"] == 8
    assert cfg.sglang.args["enable-metrics"] is True
    assert cfg.sglang.env == {"SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION": "1", "SPT_NOENV": "1"}
    assert cfg.profile_names == ("primary", "fallback")
    assert cfg.profiles["fallback"].args["speculative-algorithm"] is None
    assert cfg.restart.fallback_profile == "fallback"
    assert (cfg.restart.backoff_initial, cfg.restart.backoff_max) == (5.0, 300.0)
    assert (cfg.restart.crash_loop.max_restarts, cfg.restart.crash_loop.window) == (5, 3600.0)
    assert cfg.readiness.load_timeout == 1800.0
    assert cfg.readiness.probe.max_tokens == 8
    assert (cfg.liveness.interval, cfg.liveness.timeout) == (15.0, 20.0)
    assert cfg.admin.listen == "127.0.0.1:29400"
    assert cfg.gpus.devices == "all"
    assert cfg.logging.format == "json"


def test_minimal_config_gets_the_contract_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    cfg = config.parse("sglang: {model_path: /m}\n", "min.yaml")
    assert cfg.sglang.python == "/opt/sglang/venv/bin/python"
    assert cfg.sglang.module == "sglang.launch_server"
    assert (cfg.sglang.host, cfg.sglang.port, cfg.sglang.workdir) == ("127.0.0.1", 30000, None)
    assert cfg.profile_names == ("primary",)
    assert cfg.restart.fallback_profile is None
    assert cfg.readiness.probe.endpoint == "generate"
    assert cfg.readiness.probe.expect_regex is None
    assert cfg.liveness.failure_threshold == 3
    assert cfg.stop.drain_timeout == 60.0
    assert cfg.gpus.manage is True
    assert cfg.gpus.leftover_policy == "kill-matching"
    assert cfg.gpus.match == ("sglang", "launch_server")
    assert cfg.gpus.memory_free_threshold_mib == 1024
    assert cfg.admin.listen == "127.0.0.1:29400"
    assert cfg.state_dir == "/var/lib/kimi-serve"
    assert cfg.logs.fatal_patterns == config.DEFAULT_FATAL_PATTERNS
    assert cfg.logging.level == "info"


def test_state_dir_comes_from_systemd_state_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/kimi-serve:/var/lib/other")
    assert config.parse("sglang: {model_path: /m}\n", "c.yaml").state_dir == "/var/lib/kimi-serve"
    cfg = config.parse("sglang: {model_path: /m}\nstate_dir: /srv/state\n", "c.yaml")
    assert cfg.state_dir == "/srv/state"


def test_config_is_frozen() -> None:
    cfg = config.parse("sglang: {model_path: /m}\n", "c.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sglang.port = 1  # type: ignore[misc]


def test_ipv6_admin_listen_and_device_list() -> None:
    cfg = config.parse(
        "sglang: {model_path: /m, args: {tp-size: 2}}\n"
        "admin: {listen: '[::1]:29401'}\n"
        "gpus: {devices: [0, GPU-5e3c0a4e-1234]}\n",
        "c.yaml",
    )
    assert (cfg.admin.host, cfg.admin.port, cfg.admin.listen) == ("::1", 29401, "[::1]:29401")
    assert cfg.gpus.devices == (0, "GPU-5e3c0a4e-1234")


def test_profile_env_may_remove_but_base_env_may_not() -> None:
    cfg = config.parse(
        "sglang: {model_path: /m, env: {A: '1'}}\nprofiles: {p: {env: {A: null, B: x}}}\n",
        "c.yaml",
    )
    assert cfg.profiles["p"].env == {"A": None, "B": "x"}
    with pytest.raises(ConfigError) as info:
        config.parse("sglang: {model_path: /m, env: {A: null}}\n", "c.yaml")
    assert [i.path for i in info.value.issues] == ["sglang.env.A"]


def test_yaml_merge_key_is_not_a_duplicate() -> None:
    cfg = config.parse(
        "sglang:\n  model_path: /m\n  env: &base {A: '1'}\n"
        "profiles:\n  p:\n    env:\n      <<: *base\n      B: '2'\n",
        "c.yaml",
    )
    assert cfg.profiles["p"].env == {"A": "1", "B": "2"}


def test_tp_size_of_a_profile_is_checked_against_devices() -> None:
    text = (
        "sglang: {model_path: /m, args: {tensor-parallel-size: 2}}\n"
        "profiles:\n  wide:\n    args:\n      tensor-parallel-size: 8\n"
        "gpus: {devices: [0, 1]}\n"
    )
    with pytest.raises(ConfigError) as info:
        config.parse(text, "c.yaml")
    [issue] = info.value.issues
    assert issue.path == "profiles.wide.args.tensor-parallel-size"
    assert issue.line == 5
    assert "needs 8 GPUs but gpus.devices lists 2" in issue.message


def test_render_names_file_line_and_key() -> None:
    err = ConfigError(
        "f.yaml",
        [config.ConfigIssue("a.b", 3, "bad"), config.ConfigIssue("c", None, "worse")],
    )
    assert err.render() == "f.yaml:3: a.b: bad\nf.yaml: c: worse"
    assert str(err) == err.render()


# --------------------------------------------------------------------------------------------
# Durations and addresses
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1.5s", 1.5),
        ("0.5h", 1800.0),
        (" 2m ", 120.0),
        ("0", 0.0),
        ("90", 90.0),
        (45, 45.0),
        (2.5, 2.5),
        (0, 0.0),
    ],
)
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "value",
    [
        "10 minutes",
        "-5s",
        "5 m s",
        "1d",
        "",
        "s",
        "1e3",
        ".5s",
        True,
        False,
        None,
        [],
        -1,
        -0.5,
        float("nan"),
        float("inf"),
        10**400,
        "1" + "0" * 400,
    ],
    ids=lambda v: repr(v)[:24],
)
def test_parse_duration_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:29400", ("127.0.0.1", 29400)),
        ("[::1]:1", ("::1", 1)),
        ("kimi.internal:65535", ("kimi.internal", 65535)),
    ],
)
def test_parse_listen(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    "text", ["localhost", "127.0.0.1", ":29400", "::1:29400", "host:0", "host:65536", "host:port"]
)
def test_parse_listen_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_listen(text)


def test_bad_yaml_issue_has_no_key_but_a_line() -> None:
    with pytest.raises(ConfigError) as info:
        config.parse("sglang:\n  model_path: [\n", "c.yaml")
    [issue] = info.value.issues
    assert issue.path == ""
    assert issue.message.startswith("invalid YAML: ")
    assert issue.line is not None


def test_corpus_yaml_errors_are_really_yaml_errors() -> None:
    # Guards the corpus itself: a yaml-* file that PyYAML accepts tests nothing.
    for file in BAD_DIR.glob("yaml-*.yaml"):
        with pytest.raises(yaml.YAMLError):
            yaml.safe_load(file.read_text())


def test_a_profile_named_fallback_is_the_default_fallback() -> None:
    base = "sglang: {model_path: /m}\nprofiles: {fallback: {args: {x: null}}}\n"
    assert config.parse(base, "t.yaml").restart.fallback_profile == "fallback"
    explicit_null = base + "restart: {fallback_profile: null}\n"
    assert config.parse(explicit_null, "t.yaml").restart.fallback_profile is None
    assert config.parse("sglang: {model_path: /m}\n", "t.yaml").restart.fallback_profile is None


# ---------------------------------------------------------------- restart.mode, ${NAME} in args


def test_restart_mode_defaults_to_relaunch_and_takes_exit() -> None:
    assert config.parse("sglang: {model_path: /m}\n", "c.yaml").restart.mode == "relaunch"
    cfg = config.parse("sglang: {model_path: /m}\nrestart: {mode: exit}\n", "c.yaml")
    assert cfg.restart.mode == "exit"


MULTI_NODE_ARGS = """sglang:
  model_path: /m
  args:
    nnodes: 2
    node-rank: ${LWS_WORKER_INDEX}
    dist-init-addr: ${LWS_LEADER_ADDRESS}:20000
    served-model-name: [kimi, "${NAME_SUFFIX}"]
    chat-template: /t/$HOME.jinja
profiles:
  fallback:
    args:
      dist-init-addr: "${LWS_LEADER_ADDRESS}:20001"
"""


def test_env_references_in_args_are_filled_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "kimi-serve-0.kimi-serve.ns")
    monkeypatch.setenv("NAME_SUFFIX", "k2")
    cfg = config.parse(MULTI_NODE_ARGS, "c.yaml")
    assert cfg.sglang.args["node-rank"] == "1"
    assert cfg.sglang.args["dist-init-addr"] == "kimi-serve-0.kimi-serve.ns:20000"
    assert cfg.sglang.args["served-model-name"] == ("kimi", "k2")
    assert cfg.sglang.args["nnodes"] == 2  # non-strings untouched
    assert cfg.sglang.args["chat-template"] == "/t/$HOME.jinja"  # only ${NAME} is a reference
    assert cfg.profiles["fallback"].args["dist-init-addr"] == "kimi-serve-0.kimi-serve.ns:20001"


def test_unset_or_empty_env_reference_names_key_line_and_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LWS_WORKER_INDEX", raising=False)
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "")
    monkeypatch.setenv("NAME_SUFFIX", "k2")
    with pytest.raises(ConfigError) as err:
        config.parse(MULTI_NODE_ARGS, "c.yaml")
    got = [(i.path, i.line) for i in err.value.issues]
    assert got == [
        ("sglang.args.node-rank", 5),
        ("sglang.args.dist-init-addr", 6),
        ("profiles.fallback.args.dist-init-addr", 12),
    ]
    text = err.value.render()
    assert "c.yaml:5: sglang.args.node-rank: '${LWS_WORKER_INDEX}' needs the environment " in text
    assert "variable LWS_WORKER_INDEX, which is not set" in text
    assert "variable LWS_LEADER_ADDRESS, which is empty" in text
