"""supervisor.cli: the `kimi-serve` command line as an operator meets it: help, usage errors,
exit codes, print-command's production flags, and no traceback for bad input."""

from __future__ import annotations

import http.server
import io
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from supervisor import __version__, cli
from supervisor.sglang import caches
from testkit import free_port

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = REPO / "etc" / "kimi-serve.yaml"
BAD = Path(__file__).resolve().parent / "configs" / "bad" / "multiple-errors.yaml"
KIMI_SERVE = Path(sys.executable).with_name("kimi-serve")

# Every command, and words its --help must use to say what it is for.
PURPOSE = {
    "run": "run the daemon",
    "check": "validate the config file",
    "preflight": "host checks",
    "print-command": "exact SGLang command line",
    "probe": "readiness decode probe",
    "gpu-clean": "leftover GPU processes",
    "status": "running daemon for its state",
    "incidents": "incident directories",
    "demo": "SGLang stand-in",
    "restart": "restart SGLang",
    "drain": "deregister from the router",
    "undrain": "register with the router again",
    "canary": "golden answers",
    "reexec": "fresh exec of the installed kimi-serve",
    "upgrade": "last known good",
}

PRODUCTION_FLAGS = [
    ["--tp-size", "8"],
    ["--speculative-algorithm", "EAGLE3"],
    ["--speculative-draft-model-path", "/shared/kimi-k2.5-eagle3"],
    ["--speculative-num-steps", "3"],
    ["--speculative-eagle-topk", "1"],
    ["--speculative-num-draft-tokens", "4"],
    ["--attention-backend", "flashinfer"],
    ["--flashinfer-allreduce-fusion-backend", "auto"],
    ["--cuda-graph-max-bs-decode", "128"],
    ["--reasoning-parser", "kimi_k2"],
    ["--tool-call-parser", "kimi_k2"],
    ["--enable-hierarchical-cache"],
    ["--enable-metrics"],
    ["--trust-remote-code"],
    ["--port", "30000"],
    ["--host", "127.0.0.1"],
    ["--model-path", "/shared/kimi-k2.5-int4"],
]


def kimi_serve(*args: str) -> subprocess.CompletedProcess[str]:
    assert KIMI_SERVE.exists(), f"console script {KIMI_SERVE} missing: pip install -e '.[test]'"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KIMI_SERVE_CONFIG", "KIMI_SERVE_DEBUG", "NOTIFY_SOCKET")
    }
    done = subprocess.run(
        [str(KIMI_SERVE), *args], capture_output=True, text=True, env=env, timeout=60, cwd=REPO
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done


def contains_run(argv: list[str], run: list[str]) -> bool:
    return any(argv[i : i + len(run)] == run for i in range(len(argv) - len(run) + 1))


# --------------------------------------------------------------------------------------------
# Help and usage
# --------------------------------------------------------------------------------------------


def test_every_contract_command_exists() -> None:
    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    assert set(sub.choices) == set(PURPOSE)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", PURPOSE)
def test_command_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert out.startswith(f"usage: kimi-serve {command}")
    assert PURPOSE[command] in out
    if command != "demo":
        assert "--config FILE" in out
    # The epilog: every exit status the command gives, 0 first.
    assert "exit status: 0" in out


def test_top_level_help_lists_every_command() -> None:
    done = kimi_serve("--help")
    assert done.returncode == 0
    for command in PURPOSE:
        assert command in done.stdout


def test_no_command_is_a_usage_error() -> None:
    done = kimi_serve()
    assert done.returncode == 2
    assert done.stderr.startswith("usage: kimi-serve")
    assert "the following arguments are required: COMMAND" in done.stderr
    assert done.stdout == ""


def test_unknown_command_is_a_usage_error() -> None:
    done = kimi_serve("restart-everything")
    assert done.returncode == 2
    assert "invalid choice: 'restart-everything'" in done.stderr


def test_version() -> None:
    done = kimi_serve("--version")
    assert (done.returncode, done.stdout) == (0, f"kimi-serve {__version__}\n")


# --------------------------------------------------------------------------------------------
# Bad config: 78 from every command that reads one
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command", ["run", "check", "preflight", "print-command", "probe", "gpu-clean", "status"]
)
def test_bad_config_exits_78_from_every_command(command: str) -> None:
    done = kimi_serve(command, "--config", str(BAD))
    assert done.returncode == cli.EX_CONFIG, done.stderr
    assert f"{BAD}:9: sglang.port: 70000 is out of range" in done.stderr
    assert len(done.stderr.splitlines()) == 6


# --------------------------------------------------------------------------------------------
# print-command
# --------------------------------------------------------------------------------------------


def test_print_command_shows_every_production_flag() -> None:
    done = kimi_serve("print-command", "--config", str(PRODUCTION))
    assert done.returncode == 0, done.stderr
    first, *env = done.stdout.splitlines()
    argv = shlex.split(first)
    assert argv[:3] == ["/opt/sglang/venv/bin/python", "-m", "sglang.launch_server"]
    for run in PRODUCTION_FLAGS:
        assert contains_run(argv, run), f"{run} not in {first}"
    own = ["env: SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1", "env: SPT_NOENV=1"]
    assert [line for line in env if line in own] == own
    # Every JIT cache under warm.cache_dir (supervisor/sglang/caches.py), one line each.
    state = yaml.safe_load(PRODUCTION.read_text()).get("state_dir") or "/var/lib/kimi-serve"
    set_here = sorted(line for line in env if line not in own)
    assert set_here == sorted(f"env: {c.env}={state}/cache/{c.subdir}" for c in caches.CACHES)


def test_print_command_fallback_has_no_speculative_flags() -> None:
    done = kimi_serve("print-command", "--config", str(PRODUCTION), "--profile", "fallback")
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout.splitlines()[0])
    assert not [t for t in argv if t.startswith("--speculative")]
    assert "EAGLE3" not in argv
    for run in PRODUCTION_FLAGS:
        if not run[0].startswith("--speculative"):
            assert contains_run(argv, run), f"{run} not in fallback"


def test_print_command_unknown_profile_exits_78() -> None:
    done = kimi_serve("print-command", "--config", str(PRODUCTION), "--profile", "fastest")
    assert done.returncode == cli.EX_CONFIG
    assert done.stdout == ""
    assert str(PRODUCTION) in done.stderr
    assert "'fastest' is not defined" in done.stderr
    assert "primary, fallback" in done.stderr


# --------------------------------------------------------------------------------------------
# Commands that talk to a server or the daemon
# --------------------------------------------------------------------------------------------


def test_status_unreachable_daemon_exits_4(tmp_path: Path) -> None:
    port = free_port()
    doc = yaml.safe_load(PRODUCTION.read_text())
    doc["admin"]["listen"] = f"127.0.0.1:{port}"
    cfg = tmp_path / "kimi-serve.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    for extra in ([], ["--json"]):
        done = kimi_serve("status", "--config", str(cfg), *extra)
        assert done.returncode == 4, done.stderr
        assert done.stdout == ""
        assert f"cannot reach the daemon at http://127.0.0.1:{port}" in done.stderr


def test_probe_against_nothing_exits_1_with_a_readable_verdict() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = kimi_serve("probe", "--config", str(PRODUCTION), "--url", url)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith(f"probe {url} (generate): FAILED (connect)")
    assert "cannot connect" in done.stdout
    assert "internal error" not in done.stderr


def test_status_with_url_needs_no_config(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "kimi-serve"),
            "status",
            "--url",
            f"http://127.0.0.1:{port}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "KIMI_SERVE_CONFIG": str(tmp_path / "absent.yaml")},
    )
    assert done.returncode == 4, done.stderr
    assert "cannot reach the daemon" in done.stderr


def test_check_json_keeps_the_exit_codes(tmp_path: Path) -> None:
    bare = tmp_path / "no-spt.yaml"
    bare.write_text(PRODUCTION.read_text().replace('SPT_NOENV: "1"', 'OTHER: "1"'))
    done = kimi_serve("check", "--json", "--config", str(bare))
    assert done.returncode == 0, done
    doc = json.loads(done.stdout)
    assert (doc["ok"], doc["config"], doc["errors"]) == (True, str(bare), [])
    assert len(doc["warnings"]) == 2 and "SPT_NOENV" in doc["warnings"][0]
    broken = tmp_path / "broken.yaml"
    broken.write_text("sglang:\n  model_path: /m\nreadiness:\n  load_timeout: soon\n")
    done = kimi_serve("check", "--json", "--config", str(broken))
    assert done.returncode == 78, done
    doc = json.loads(done.stdout)
    assert doc["ok"] is False
    (error,) = doc["errors"]
    assert (error["key"], error["line"]) == ("readiness.load_timeout", 4)


def test_check_warns_without_spt_noenv(tmp_path: Path) -> None:
    text = PRODUCTION.read_text()
    assert 'SPT_NOENV: "1"' in text
    done = kimi_serve("check", "--config", str(PRODUCTION))
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "ok", "")
    # Without it: still valid (exit 0, "ok"), with one warning per profile naming the key.
    bare = tmp_path / "no-spt.yaml"
    bare.write_text(text.replace('SPT_NOENV: "1"', 'OTHER: "1"'))
    done = kimi_serve("check", "--config", str(bare))
    assert (done.returncode, done.stdout.strip()) == (0, "ok")
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and all(ln.startswith("warning: ") for ln in lines)
    assert "sglang.env has no SPT_NOENV" in lines[0] and "(profile primary)" in lines[0]
    assert "(profile fallback)" in lines[1]
    # A profile that removes it is named too.
    removed = tmp_path / "removed.yaml"
    profile = "  fallback:\n    args:\n"
    assert profile in text
    removed.write_text(
        text.replace(profile, "  fallback:\n    env: {SPT_NOENV: null}\n    args:\n")
    )
    done = kimi_serve("check", "--config", str(removed))
    assert done.returncode == 0
    assert done.stderr.count("warning:") == 1 and "profiles.fallback.env" in done.stderr


def closed_stdout_run(*args: str) -> subprocess.CompletedProcess[str]:
    """`kimi-serve ARGS | head -0`, made deterministic: stdout is a pipe whose reader has
    already gone, so the first write or flush meets EPIPE."""
    read, write = os.pipe()
    os.close(read)
    env = {
        k: v for k, v in os.environ.items() if k not in ("KIMI_SERVE_CONFIG", "KIMI_SERVE_DEBUG")
    }
    try:
        return subprocess.run(
            [str(KIMI_SERVE), *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=60,
            cwd=REPO,
        )
    finally:
        os.close(write)


class _StatusHandler(http.server.BaseHTTPRequestHandler):
    state = "ready"

    def do_GET(self) -> None:
        body = json.dumps({"state": self.state, "events": [{"at": 0, "reason": "x"}] * 50})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *_: object) -> None:
        pass


@pytest.mark.parametrize(("state", "code"), [("ready", 0), ("warming", 3)])
@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_status_into_a_closed_pipe_exits_by_the_state_quietly(
    state: str, code: int, extra: list[str]
) -> None:
    handler = type("Handler", (_StatusHandler,), {"state": state})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        done = closed_stdout_run("status", "--url", url, *extra)
    finally:
        server.shutdown()
        server.server_close()
    assert (done.returncode, done.stderr) == (code, "")


def test_check_into_a_closed_pipe_exits_0_quietly() -> None:
    done = closed_stdout_run("check", "--config", str(PRODUCTION))
    assert (done.returncode, done.stderr) == (0, "")


def test_the_stdout_a_command_gets_is_still_the_terminal_or_the_journal() -> None:
    """Wrapped against a closed pipe, but what the log's setup asks of stdout is unchanged."""
    read, write = os.pipe()
    try:
        with os.fdopen(write, "w", closefd=False) as stream:
            wrapped = cli._Stdout(stream)
            assert wrapped.fileno() == write and wrapped.isatty() is False
            wrapped.write("line\n")
            wrapped.flush()
        assert os.read(read, 100) == b"line\n"
    finally:
        os.close(read)
        os.close(write)
    controller, terminal = os.openpty()
    try:
        with os.fdopen(terminal, "w", closefd=False) as stream:
            assert cli._Stdout(stream).isatty() is True  # the demo's log keeps its colours
    finally:
        os.close(controller)
        os.close(terminal)


def test_canary_command_show_accept_forget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from supervisor.quality import Answer, KnownResult
    from supervisor.quality.golden import CanaryStore, Golden, golden_key

    cfg = tmp_path / "k.yaml"
    cfg.write_text(f"sglang:\n  model_path: /m\nstate_dir: {tmp_path / 'state'}\n")
    conf = ["--config", str(cfg)]
    assert cli.main(["canary", "show", *conf]) == 0
    assert "no golden answer" in capsys.readouterr().out
    assert cli.main(["canary", "accept", "--yes", *conf]) == 1
    assert "no canary answer received" in capsys.readouterr().err
    store = CanaryStore(str(tmp_path / "state" / "canary"))
    answer = Answer(" hi there", (5, 6), (4.0, 0.5), (7, 8))
    key = golden_key("id", "0.5.23", "p", 16)
    store.save_last(Golden(key, answer, "/m", "id", "0.5.23", "p", 16, 1.0, "received"))
    # Without --yes it asks; anything but yes accepts nothing.
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    assert cli.main(["canary", "accept", *conf]) == 1
    captured = capsys.readouterr()
    assert "would accept" in captured.out and "' hi there'" in captured.out
    assert "[y/N]" in captured.out and "not accepted" in captured.err
    assert store.goldens() == []
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    assert cli.main(["canary", "accept", *conf]) == 0
    assert "accepted ' hi there'" in capsys.readouterr().out
    assert cli.main(["canary", "show", *conf]) == 0
    out = capsys.readouterr().out
    assert f"golden {key} (accepted" in out and "1 of 2 tokens compared" in out
    assert "DIFFERS" not in out
    assert cli.main(["canary", "show", "--json", *conf]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["goldens"][0]["key"] == key and doc["last"]["differs"] is None
    # A received answer that differs from the golden is marked, and one that failed the
    # known answers is refused without --force.
    wrong = Answer(" no way", (9, 6), (4.0, 0.5), (7, 8))
    failed = (KnownResult("The capital of France is", "Paris", " Berlin"),)
    store.save_last(Golden(key, wrong, "/m", "id", "0.5.23", "p", 16, 2.0, "received", failed))
    assert cli.main(["canary", "show", *conf]) == 0
    assert "DIFFERS from the golden of its key: token 0" in capsys.readouterr().out
    assert cli.main(["canary", "show", "--json", *conf]) == 0
    assert json.loads(capsys.readouterr().out)["last"]["differs"].startswith("token 0")
    assert cli.main(["canary", "accept", "--yes", *conf]) == 1
    captured = capsys.readouterr()
    assert "FAIL known answer to 'The capital of France is' fails" in captured.out
    assert "refused: the answer failed the known answers" in captured.err
    assert store.golden(key) is not None and store.golden(key).answer.text == " hi there"  # type: ignore[union-attr]
    assert cli.main(["canary", "accept", "--yes", "--force", *conf]) == 0
    assert store.golden(key).answer.text == " no way"  # type: ignore[union-attr]
    capsys.readouterr()
    # forget forgets the received answer too: accept cannot put it back.
    assert cli.main(["canary", "forget", *conf]) == 0
    assert "forgot 1 golden answer(s) and the last received answer" in capsys.readouterr().out
    assert store.goldens() == [] and store.last() is None
    assert cli.main(["canary", "accept", "--yes", *conf]) == 1


def test_canary_try_without_a_server_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from testkit import free_port

    cfg = tmp_path / "k.yaml"
    cfg.write_text(
        f"sglang:\n  model_path: /m\n  port: {free_port()}\nstate_dir: {tmp_path / 'state'}\n"
        "quality:\n  known_answers: [{prompt: 'The capital of France is', expect: Paris}]\n"
    )
    assert cli.main(["canary", "try", "--config", str(cfg)]) == 4
    out = capsys.readouterr().out
    assert "canary  canary request failed" in out
    assert "known   FAIL known answer to 'The capital of France is': canary request failed" in out


def test_canary_accept_refuses_an_answer_the_known_answers_were_not_asked_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from supervisor.quality import Answer
    from supervisor.quality.golden import CanaryStore, Golden, golden_key

    cfg = tmp_path / "k.yaml"
    cfg.write_text(
        f"sglang:\n  model_path: /m\nstate_dir: {tmp_path / 'state'}\n"
        "quality:\n  known_answers: [{prompt: 'The capital of France is', expect: Paris}]\n"
    )
    store = CanaryStore(str(tmp_path / "state" / "canary"))
    key = golden_key("id", "0.5.23", "p", 16)
    answer = Answer(" hi there", (5, 6), (4.0, 0.5), (7, 8))
    store.save_last(Golden(key, answer, "/m", "id", "0.5.23", "p", 16, 1.0, "received"))
    assert cli.main(["canary", "accept", "--yes", "--config", str(cfg)]) == 1
    captured = capsys.readouterr()
    assert "FAIL known answer to 'The capital of France is': not asked" in captured.out
    assert "refused" in captured.err and store.goldens() == []
    assert cli.main(["canary", "accept", "--yes", "--force", "--config", str(cfg)]) == 0
    assert [g.answer.text for g in store.goldens()] == [" hi there"]


def test_drain_accepts_wait_and_it_changes_nothing() -> None:
    from supervisor.admin import control_commands as control
    from supervisor.cli.parser import build_parser

    args = build_parser().parse_args(["drain", "--wait", "--url", "http://127.0.0.1:9"])
    req = control.request_of(args, "http://127.0.0.1:9", "/nonexistent")
    assert args.wait is True and req.wait is False  # the drain's answer is its end
    assert req.timeout == control.ANSWER_TIMEOUT["drain"]
