"""Secrets out of SGLang's log lines, command lines and the config's key file: the redaction
itself, print-command as an operator runs it, the key file's checks, and the log pump's tail."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from supervisor import config, redact
from supervisor.daemon.logpump import LogPump
from supervisor.metrics import Metrics
from supervisor.sglang import api_key as sglang_key
from supervisor.sglang import argv as command
from supervisor.sglang.logscan import Stream

KEY = "sk-live-0123456789abcdef"
KIMI_SERVE = Path(sys.executable).with_name("kimi-serve")

# SGLang 0.5.23's line (srt/entrypoints/engine.py:1185, `logger.info(f"server_args={...}")`),
# as its log format prints it.
SERVER_ARGS_LINE = (
    "[2026-12-01 21:47:47] server_args={'model_path': '/models/tiny', 'tokenizer_path': "
    f"'/models/tiny', 'api_key': '{KEY}', 'admin_api_key': '{KEY}-admin', 'max_tokens': 8, "
    f"'hf_token': \"{KEY}-hf\", 'watermark_key': None, 'port': 30000}}"
)


@pytest.mark.parametrize(
    "line",
    [
        SERVER_ARGS_LINE,
        f"ServerArgs(model_path='/m', api_key='{KEY}', port=30000)",
        f"python -m sglang.launch_server --api-key {KEY} --port 3",
        f"python -m sglang.launch_server --admin-api-key={KEY}",
        f'request headers: {{"Authorization": "Bearer {KEY}"}}',
        f"Authorization: Bearer {KEY}",
        f"client_secret={KEY}",
    ],
)
def test_a_secret_never_survives(line: str) -> None:
    out = redact.line(line)
    assert KEY not in out and redact.REDACTED in out


def test_what_is_not_a_secret_is_left_alone() -> None:
    out = redact.line(SERVER_ARGS_LINE)
    assert "'tokenizer_path': '/models/tiny'" in out and "'max_tokens': 8" in out
    assert "'watermark_key': None" in out and "'port': 30000" in out
    decode = "Decode batch. #running-req: 1, #token: 36, token usage: 0.00, gen throughput"
    assert redact.line(decode) == decode


# The pieces a log line is made of here: secret-looking names in each of the forms the
# patterns know, SGLang's ordinary words, separators and values.
_PIECES = st.sampled_from(
    [
        "api_key",
        "admin-api-key",
        "hf_token",
        "client_secret",
        "password",
        "token",
        "#token",
        "token usage",
        "max_tokens",
        "tokenizer_path",
        "key",
        "Bearer",
        "basic",
        "Authorization",
        "--",
        "-",
        "=",
        ":",
        "'",
        '"',
        " ",
        "  ",
        ",",
        "{",
        "}",
        "(",
        ")",
        "[",
        "]",
        KEY,
        "None",
        "30000",
        "Decode batch.",
        "gen throughput (token/s)",
        "\t",
    ]
)


_NAMES = st.sampled_from(
    ["api_key", "admin-api-key", "hf_token", "client_secret", "password", "token", "key", "port"]
)
_FORMS = st.sampled_from(
    [
        "{n}={v}",
        "--{n} {v}",
        "--{n}={v}",
        "'{n}': '{v}'",
        '"{n}": "{v}"',
        "{n}: {v}",
        "#{n}: {v}",
        "{n} {v}",
        "'{n}'  :  \"{v}\"",
    ]
)
_NOISE = st.lists(_PIECES, max_size=4).map("".join)


@given(_NOISE, _NAMES, _FORMS, st.sampled_from([KEY, "None", "30", "''"]), _NOISE)
def test_the_quick_test_never_skips_a_line_a_pattern_would_change(
    before: str, name: str, form: str, value: str, after: str
) -> None:
    """The cheap pre-test only saves time: a line it lets through unchanged is one that every
    pattern would have left as it is."""
    text = before + form.format(n=name, v=value) + after
    assert redact.line(text) == redact._every_pattern(text)


@given(st.lists(_PIECES, max_size=14).map("".join))
def test_the_quick_test_never_skips_a_line_of_pieces(text: str) -> None:
    assert redact.line(text) == redact._every_pattern(text)


def test_sglangs_decode_lines_skip_the_patterns() -> None:
    decode = (
        "[2026-12-01 21:47:50] Decode batch. #running-req: 1, #token: 36, token usage: 0.00, "
        "cuda graph: False, gen throughput (token/s): 5.33, #queue-req: 0"
    )
    assert not redact._could_hold_a_secret(decode)
    assert redact._could_hold_a_secret(SERVER_ARGS_LINE)


def test_print_command_never_shows_the_key(tmp_path: Path) -> None:
    key_file = tmp_path / "sglang.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    cfg_file = tmp_path / "kimi-serve.yaml"
    doc = {
        "sglang": {
            "model_path": "/models/kimi",
            "api_key_file": str(key_file),
            "env": {"HF_TOKEN": KEY},
        },
        "state_dir": str(tmp_path / "state"),
        # An operator who put the key in the args anyway: ps shows it, print-command does not.
        "profiles": {"keyed": {"args": {"api-key": KEY}}},
    }
    cfg_file.write_text(yaml.safe_dump(doc))
    for profile in ("primary", "keyed"):
        done = subprocess.run(
            [str(KIMI_SERVE), "print-command", "--config", str(cfg_file), "--profile", profile],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert KEY not in done.stdout + done.stderr
        assert f"--config {tmp_path / 'state' / 'sglang-secrets.yaml'}" in done.stdout
    assert "--api-key '<redacted>'" in done.stdout or "--api-key <redacted>" in done.stdout


def test_the_keyed_argv_carries_the_secrets_file_and_not_the_key(tmp_path: Path) -> None:
    key_file = tmp_path / "k"
    key_file.write_text(KEY)
    key_file.chmod(0o400)
    cfg = config.parse(
        f"sglang: {{model_path: /m, api_key_file: {key_file}}}\nstate_dir: {tmp_path}\n", "t.yaml"
    )
    spec = command.build(cfg)
    assert KEY not in " ".join(spec.argv)
    path = sglang_key.write_secrets(str(tmp_path), sglang_key.configured_key(cfg) or "")
    assert spec.argv[-2:] == ("--config", path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert yaml.safe_load(Path(path).read_text()) == {"api-key": KEY}


@pytest.mark.parametrize(
    ("mode", "why"),
    [(0o644, "others may read or write it"), (0o660, "its group may write it")],
)
def test_a_key_file_others_may_read_is_a_config_error(tmp_path: Path, mode: int, why: str) -> None:
    key_file = tmp_path / "k"
    key_file.write_text(KEY)
    key_file.chmod(mode)
    with pytest.raises(config.ConfigError) as err:
        config.parse(f"sglang:\n  model_path: /m\n  api_key_file: {key_file}\n", "t.yaml")
    text = str(err.value)
    assert text.startswith("t.yaml:3: sglang.api_key_file: ") and why in text


def test_a_key_file_of_another_user_is_refused_by_the_daemon(tmp_path: Path) -> None:
    key_file = tmp_path / "k"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    os.chown(key_file, 65534, 65534)
    with pytest.raises(sglang_key.KeyFileError, match="belongs to uid 65534"):
        sglang_key.read(str(key_file), owners=(os.geteuid(),))


def test_the_log_pump_keeps_and_forwards_the_line_redacted() -> None:
    cfg = config.parse("sglang: {model_path: /m}\n", "t.yaml")
    pump = LogPump(cfg, Metrics(), lambda: 0.0, lambda _e: None)
    recorded: list[str] = []
    pump.on_line = lambda line, _t: recorded.append(line)
    pump.lines(1, Stream.STDERR, [SERVER_ARGS_LINE])
    assert KEY not in "\n".join(pump.tail()) and "server_args=" in pump.tail()[-1]
    assert recorded and KEY not in recorded[0]


async def test_the_key_goes_to_sglang_only_and_never_over_another_token() -> None:
    import httpx

    seen: dict[str, str | None] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen[str(request.url)] = request.headers.get("authorization")
        return httpx.Response(200)

    auth = sglang_key.Bearer("http://127.0.0.1:30000", KEY)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), auth=auth) as client:
        await client.post("http://127.0.0.1:30000/generate")
        await client.get("http://127.0.0.1:30000/server_info")
        await client.get("http://10.0.0.2:29400/group", headers={"Authorization": "Bearer g"})
        await client.get("http://127.0.0.1:29400/status")  # another port: not SGLang
        await client.post("http://router:30000/workers")
    assert seen == {
        "http://127.0.0.1:30000/generate": f"Bearer {KEY}",
        "http://127.0.0.1:30000/server_info": f"Bearer {KEY}",
        "http://10.0.0.2:29400/group": "Bearer g",
        "http://127.0.0.1:29400/status": None,
        "http://router:30000/workers": None,
    }


def test_check_warns_about_a_key_on_the_command_line(tmp_path: Path) -> None:
    cfg_file = tmp_path / "kimi-serve.yaml"
    cfg_file.write_text(
        yaml.safe_dump(
            {
                "sglang": {
                    "model_path": "/models/kimi",
                    "args": {"api-key": KEY},
                    "env": {"SPT_NOENV": "1"},
                },
                "state_dir": str(tmp_path),
            }
        )
    )
    done = subprocess.run(
        [str(KIMI_SERVE), "check", "--config", str(cfg_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "sglang.args api-key (profile primary) is on SGLang's command line" in done.stderr
    assert "sglang.api_key_file" in done.stderr and KEY not in done.stdout + done.stderr


def test_a_key_link_another_user_planted_is_not_followed(tmp_path: Path) -> None:
    """Root's CLI reads the key to probe SGLang: a link of another user's making must not
    lead it to a file of that user's choosing (the admin token's link rules)."""
    target = tmp_path / "roots-secret"
    target.write_text("not-the-key\n")
    target.chmod(0o600)
    link = tmp_path / "key"
    link.symlink_to(target)
    os.lchown(link, 65534, 65534)
    with pytest.raises(sglang_key.KeyFileError, match="link"):
        sglang_key.read(str(link), owners=())


# ------------------------------------------------------------------ linear in the line

# Lines that made a pattern of this module backtrack, or search from every position: the
# quoted item's value (`\\.` or any character: two ways per backslash; 40 backslashes stalled
# the loop for 24 s), and the cheap test's names (`key` x 5000 then `'`; `-` x 16000 then
# `key`). Each is cut to MAX_LINE_BYTES first and must cost well under a millisecond a KiB.
HOSTILE_LINES = {
    "quoted value of backslashes": "'api_key': '" + "\\" * 40,
    "quoted value of backslashes, cut": "'api_key': '" + "\\" * 100_000,
    "an odd backslash at the end": "'api_key': '" + "\\" * 16_001,
    "names of key": "key" * 5_000 + "'",
    "a flag of dashes": "--" + "-" * 16_000 + "key",
    "quoted heads": "'api_key': '" * 1_300,
    "keyword heads": "api_key=' " * 1_600,
    "a name without its quote": "'" + "a" * 16_000 + "key",
}


@pytest.mark.parametrize("what", list(HOSTILE_LINES))
def test_every_pattern_is_linear_on_a_hostile_line(what: str) -> None:
    text = HOSTILE_LINES[what]
    start = time.perf_counter()
    out = redact.line(text)
    took = time.perf_counter() - start
    assert len(out.encode()) <= 3 * redact.MAX_LINE_BYTES  # <redacted> may outgrow a value
    assert took < 0.05, f"{what}: {took * 1000:.1f} ms"  # exponential: seconds to hours


def test_a_secret_cut_at_the_line_limit_is_still_redacted() -> None:
    pad = "x" * (redact.MAX_LINE_BYTES - 30)
    out = redact.line(f"server_args={{{pad}, 'api_key': 'sk-0123456789abcdef0123456789'}}")
    assert "'api_key': '<redacted>" in out and "sk-0123" not in out, out[-80:]
    assert out.endswith("bytes cut]"), out[-40:]


def test_a_document_deeper_than_the_limit_is_redacted_not_recursed() -> None:
    doc: object = {"api_key": "sk-1"}
    for _ in range(5000):
        doc = {"a": doc}
    out = redact.document(doc)
    for _ in range(redact.MAX_DEPTH):
        out = out["a"]
    assert out == redact.REDACTED
