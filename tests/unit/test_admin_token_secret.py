"""The admin token from a Kubernetes Secret volume: a real directory laid out as the kubelet's
atomic writer lays it out (`token -> ..data/token`, `..data -> ..<timestamp>`, the mount point
a tmpfs of mode 1777, files of `defaultMode`), rotated the way the kubelet rotates it (a new
timestamped directory, `..data_tmp` renamed over `..data`, the old directory removed)."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from supervisor import admin
from supervisor import secret_files as admin_token
from testkit.admin import Backend
from testkit.daemon import BIN, base_config

KEY = "token"


def project(volume: Path, files: dict[str, str], mode: int = 0o400) -> Path:
    """One write of the kubelet's atomic writer (pkg/volume/util/atomic_writer.go): the
    payload in a new `..<timestamp>` directory (0755), the visible links, the `..data` swap,
    the old directory removed. Returns the new timestamped directory."""
    data = volume / "..data"
    old = volume / os.readlink(data) if data.is_symlink() else None
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime()) + secrets.token_hex(5)
    ts = volume / stamp
    ts.mkdir()
    ts.chmod(0o755)
    for name, text in files.items():
        (ts / name).write_text(text)
        (ts / name).chmod(mode)
    for name in files:
        if not (volume / name).is_symlink():
            (volume / name).symlink_to(f"..data/{name}")
    (volume / "..data_tmp").symlink_to(stamp)
    os.rename(volume / "..data_tmp", data)
    if old is not None:
        shutil.rmtree(old)
    return ts


def secret_volume(tmp: Path, mode: int = 0o400) -> tuple[Path, str]:
    volume = tmp / "admin-token"
    volume.mkdir()
    volume.chmod(0o1777)  # what a Secret's tmpfs mount point shows
    token = secrets.token_urlsafe(32)
    project(volume, {KEY: token + "\n"}, mode)
    return volume / KEY, token


def test_a_secret_mounted_token_is_read_through_its_links(tmp_path: Path) -> None:
    path, token = secret_volume(tmp_path)
    assert path.is_symlink() and (path.parent / "..data").is_symlink()
    loaded = admin_token.ensure(str(path))
    assert loaded.value == token and loaded.matches(token)
    real, _ = admin_token.resolve(str(path))
    assert Path(real).parent.name.startswith("..20") and Path(real).name == KEY
    # The CLI's read (kimi-serve restart, the group's polls) follows the links too.
    assert admin_token.read_for_client(str(path)) == token


def test_the_default_secret_mode_0644_is_refused_naming_the_file(tmp_path: Path) -> None:
    path, _ = secret_volume(tmp_path, mode=0o644)
    with pytest.raises(admin_token.TokenFileError) as caught:
        admin_token.ensure(str(path))
    message = str(caught.value)
    assert str(path) in message and "-> " in message, message
    assert "mode 0644" in message and "defaultMode 0400" in message, message


def test_a_rotated_secret_takes_effect_and_the_old_token_is_refused(tmp_path: Path) -> None:
    path, old = secret_volume(tmp_path)
    first = admin_token.load(str(path))
    assert first.value == old and not admin_token.changed(first, str(path))
    new = secrets.token_urlsafe(32)
    project(path.parent, {KEY: new + "\n"})
    # The visible link did not change; what it resolves to did.
    assert admin_token.changed(first, str(path))
    assert admin_token.load(str(path)).value == new
    assert len([p for p in path.parent.iterdir() if p.name.startswith("..20")]) == 1


async def test_the_admin_endpoint_follows_a_secret_rotation(tmp_path: Path) -> None:
    path, old = secret_volume(tmp_path)
    backend = Backend(tmp_path)
    backend.cfg = dataclasses.replace(
        backend.cfg, admin=dataclasses.replace(backend.cfg.admin, token_file=str(path))
    )
    served = await admin.open_endpoint(backend, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{served.port}/restart"
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=5) as client:

            async def restart(token: str) -> int:
                r = await client.post(url, headers={"Authorization": f"Bearer {token}"})
                return r.status_code

            assert await restart(old) == 202
            new = secrets.token_urlsafe(32)
            project(path.parent, {KEY: new + "\n"})
            assert await restart(old) == 401
            assert await restart(new) == 202
            assert backend.restarts == 2
    finally:
        await served.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="lchown to another user needs root")
def test_a_link_another_user_made_is_not_followed(tmp_path: Path) -> None:
    path, _ = secret_volume(tmp_path)
    os.lchown(path, 65534, 65534)  # in the sticky directory: someone else's link
    with pytest.raises(admin_token.TokenFileError, match="belongs to uid 65534"):
        admin_token.load(str(path))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    path, _ = secret_volume(tmp_path)
    real, _ = admin_token.resolve(str(path))
    os.chown(Path(real).parent, 65534, 65534)
    with pytest.raises(admin_token.TokenFileError, match="belongs to uid 65534"):
        admin_token.load(str(path))


def test_a_mount_point_others_can_write_without_the_sticky_bit_is_refused(
    tmp_path: Path,
) -> None:
    path, _ = secret_volume(tmp_path)
    path.parent.chmod(0o777)  # anyone could rename ..data to a directory of their own
    with pytest.raises(admin_token.TokenFileError, match="writable by others"):
        admin_token.load(str(path))


def test_a_timestamped_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    path, _ = secret_volume(tmp_path)
    Path(admin_token.resolve(str(path))[0]).parent.chmod(0o775)
    with pytest.raises(admin_token.TokenFileError, match="mode 0775"):
        admin_token.load(str(path))


def test_a_link_to_a_file_others_can_read_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.token"
    real.write_text(secrets.token_urlsafe(32) + "\n")
    real.chmod(0o644)
    link = tmp_path / "admin.token"
    link.symlink_to(real)
    with pytest.raises(admin_token.TokenFileError, match="mode 0644") as caught:
        admin_token.load(str(link))
    assert f"{link} (-> {real})" in str(caught.value)


def test_a_link_loop_and_a_dangling_link_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(admin_token.TokenFileError, match="more than 40 links"):
        admin_token.load(str(tmp_path / "a"))
    path, _ = secret_volume(tmp_path)
    (path.parent / "..data").unlink()
    with pytest.raises(admin_token.TokenFileError, match=r"does not exist \(.*\.\.data is missing"):
        admin_token.load(str(path))


def test_the_daemon_refuses_an_unsafe_secret_with_78_naming_file_and_key(tmp_path: Path) -> None:
    path, _ = secret_volume(tmp_path, mode=0o644)
    cfg = base_config(tmp_path, admin={"token_file": str(path)})
    config_path = tmp_path / "kimi-serve.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run(
        [str(BIN), "run", "--config", str(config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 78, r.stdout + r.stderr
    assert f"admin token file {path}" in r.stderr and "mode 0644" in r.stderr, r.stderr
    assert f"admin.token_file in {config_path}" in r.stderr, r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_a_relative_link_through_a_parent_directory_is_resolved_as_the_kernel_does(
    tmp_path: Path,
) -> None:
    (tmp_path / "a").mkdir(mode=0o755)
    (tmp_path / "b").mkdir(mode=0o755)
    token = admin_token.ensure(str(tmp_path / "b" / "admin.token"))
    (tmp_path / "a" / "link").symlink_to("../b/admin.token")
    assert admin_token.resolve(str(tmp_path / "a" / "link"))[0] == str(
        tmp_path / "b" / "admin.token"
    )
    assert admin_token.load(str(tmp_path / "a" / "link")) == token
