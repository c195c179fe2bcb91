"""`kimi-serve demo --fault seed-incident` as the README tells a newcomer to run it: the real
demo process, then the `status:` command its banner prints, pasted as printed."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from testkit import wait_until

REPO = Path(__file__).resolve().parents[2]
KIMI_SERVE = Path(sys.executable).with_name("kimi-serve")
SEEDED = "AttributeError: 'EAGLEWorkerV2' object has no attribute 'spec_disable_batch_threshold'"


def banner_command(proc: subprocess.Popen[str], label: str) -> list[str]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip().startswith(f"{label}:"):
            return shlex.split(line.split(":", 1)[1])
    raise AssertionError(f"the banner has no {label}: line")


@contextlib.contextmanager
def demo(tmp_path: Path, fault: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """`kimi-serve demo --fault FAULT` as a newcomer runs it; stopped with Ctrl-C (SIGINT),
    which must end it with 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("KIMI_SERVE_CONFIG", "NOTIFY_SOCKET")}
    proc = subprocess.Popen(
        [str(KIMI_SERVE), "demo", "--fault", fault, "--load-seconds", "0.3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        yield proc, env
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_the_readme_status_command_shows_the_seeded_traceback(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    assert "scripts/demo --fault seed-incident" in readme
    assert "the `status:` command the demo prints" in readme
    with demo(tmp_path, "seed-incident") as (proc, env):
        command = banner_command(proc, "status")
        assert command[0] == str(KIMI_SERVE) and command[1:3] == ["status", "--config"]

        def restarted() -> bool:
            done = subprocess.run(
                [*command, "--json"], capture_output=True, text=True, env=env, timeout=30
            )
            return done.returncode in (0, 3) and bool(json.loads(done.stdout).get("last_restart"))

        wait_until(restarted, 60, "the seeded decode's death, recorded", interval=0.2)
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=30)
        assert done.returncode in (0, 3), done.stderr
        assert "Last restart: fatal_log" in done.stdout, done.stdout
        assert SEEDED in done.stdout and "lines SGLang printed" in done.stdout
        # Without the token (the URL alone) the state, but not what SGLang printed.
        listen = yaml.safe_load(Path(command[3]).read_text())["admin"]["listen"]
        bare = [str(KIMI_SERVE), "status", "--url", f"http://{listen}"]
        done = subprocess.run(bare, capture_output=True, text=True, env=env, timeout=30)
        assert done.returncode in (0, 3) and "State: " in done.stdout, done.stderr
        assert "EAGLEWorkerV2" not in done.stdout and "shown with the admin token" in done.stdout


@pytest.mark.slow
def test_the_wrong_answer_demo_shows_the_mismatch_caught_not_learned(tmp_path: Path) -> None:
    lines: list[str] = []
    with demo(tmp_path, "wrong-answer") as (proc, _):
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "new=ready" in line:
                break
        out = "".join(lines)
        assert "its known answer fails" in out  # the banner says what to watch
        caught = next(i for i, ln in enumerate(lines) if "reason=canary_mismatch" in ln)
        assert "known answer to 'kimi serves answers' fails" in lines[caught]
        learned = next(i for i, ln in enumerate(lines) if "canary golden learned" in ln)
        assert caught < learned, "the wrong answer is never learned"
        assert "(launch 2; faults: none)" in "".join(lines[caught:learned])
        assert sum("new=ready" in ln for ln in lines) == 1 and "new=ready" in lines[-1]
