"""The admin token end to end: the real daemon (with the stand-in) on loopback, the real
`kimi-serve` commands with the token and without the right to read it."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import yaml

from testkit import base_config, running
from testkit.cli import kimi_serve

pytestmark = pytest.mark.timeout(90)


def test_the_commands_with_and_without_the_token(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (to drop the capability to read any file)")
    cfg = base_config(tmp_path)
    with running(tmp_path, cfg) as d:
        d.wait_state("ready")
        config = str(d.config_path)
        token_file = Path(cfg["state_dir"]) / "admin.token"
        st = token_file.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, os.geteuid())
        # A copy nobody may read (mode 0000: only a process with CAP_DAC_OVERRIDE gets in).
        unreadable = tmp_path / "unreadable.token"
        shutil.copy(token_file, unreadable)
        unreadable.chmod(0)

        # Without the token: `status` works and says what it leaves out; `restart` names
        # the file and who may read it, and does nothing.
        args = ("--config", config, "--token-file", str(unreadable))
        done = kimi_serve("status", *args, unprivileged=True)
        assert done.returncode == 0, done.stderr
        assert "State: ready" in done.stdout and done.stderr == ""
        done = kimi_serve("restart", *args, unprivileged=True)
        assert done.returncode == 77, done
        assert done.stderr.count("\n") == 1
        assert f"cannot read the admin token file {unreadable}: permission denied" in done.stderr
        assert "only root and the service user (root) may read it" in done.stderr
        assert d.status()["restarts"] == {}

        # With it (root, the config's admin.token_file): accepted, and it happens.
        done = kimi_serve("restart", "--config", config)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("restart accepted: ")
        restarting = d.wait_state("restarting")
        assert restarting["reason"] == "manual"
        d.wait_state("ready")
        assert d.status()["restarts"] == {"manual": 1}

        # Drain and undrain with the token: without a router only /readyz changes.
        done = kimi_serve("drain", "--config", config)
        assert done.returncode == 0, done
        assert "router.url is not set" in done.stdout
        d.wait_state("draining")
        assert d.get("/readyz").status_code == 503
        done = kimi_serve("undrain", "--config", config)
        assert done.returncode == 0, done
        d.wait_state("ready")

        # A token file of another daemon (same port, wrong file): 77, nothing done.
        other = tmp_path / "other.token"
        other.write_text("x" * 43 + "\n")
        other.chmod(0o600)  # one others could read is refused before it is sent
        done = kimi_serve("restart", "--config", config, "--token-file", str(other))
        assert done.returncode == 77 and "rejected the token" in done.stderr, done
        denied = d.get("/metrics").text
        assert 'kimi_serve_admin_denied_total{endpoint="/restart"} 1.0' in denied
        assert d.status()["restarts"] == {"manual": 1}
        assert d.stop() == 0


def test_a_readable_token_file_stops_the_start_with_78(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    state = Path(cfg["state_dir"])
    state.mkdir()
    token_file = state / "admin.token"
    token_file.write_text("y" * 43 + "\n")
    token_file.chmod(0o644)
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = kimi_serve("run", "--config", str(path))
    assert done.returncode == 78, done
    assert f"admin token file {token_file} is mode 0644" in done.stderr
    assert f"(admin.token_file in {path})" in done.stderr
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o644  # refused, not repaired


def test_a_remote_listen_without_allow_remote_is_78(tmp_path: Path) -> None:
    cfg = base_config(tmp_path, admin={"listen": "0.0.0.0:29400"})
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    for command in ("check", "run"):
        done = kimi_serve(command, "--config", str(path))
        assert done.returncode == 78, done
        assert f"{path}:" in done.stderr and "admin.listen: 0.0.0.0:29400 is not a loopback" in (
            done.stderr
        )


def test_a_token_directory_others_can_write_stops_the_start_with_78(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    state = Path(cfg["state_dir"])
    state.mkdir()
    state.chmod(0o777)
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = kimi_serve("run", "--config", str(path))
    assert done.returncode == 78, done
    assert f"{state} (where the admin token file goes) is writable by others" in done.stderr
    assert not (state / "admin.token").exists()
