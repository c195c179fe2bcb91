"""SGLang's compile caches: where they go, and the warnings about where they are."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from supervisor import cli, config, preflight
from supervisor.sglang import caches
from supervisor.sglang.caches import Mount
from testkit.cli import kimi_serve
from testkit.users import system_user

# A real mountinfo's shapes (proc(5)): the root, a tmpfs /dev/shm, a unit's PrivateTmp bind.
MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
25 22 0:21 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw
90 22 252:1 /tmp/systemd-private-0f3e-kimi-serve.service-Ab12/tmp /tmp rw - ext4 /dev/vda rw
91 22 252:1 /var/cache/kimi\\040serve /var/cache/kimi\\040serve rw - ext4 /dev/vda rw
"""
CONTAINER = "1 0 0:50 / / rw - overlay overlay rw,lowerdir=/a,upperdir=/b\n"


def test_every_cache_gets_a_directory_under_the_root() -> None:
    env = caches.env("/var/cache/kimi-serve")
    assert set(env) == {c.env for c in caches.CACHES}
    assert all(v.startswith("/var/cache/kimi-serve/") for v in env.values())
    assert len(set(env.values())) == len(env)  # no two caches share a directory


def test_mountinfo_is_read_with_its_escapes() -> None:
    mounts = caches.parse_mountinfo(MOUNTINFO + "garbage line\n")
    assert [m.point for m in mounts] == ["/", "/dev/shm", "/tmp", "/var/cache/kimi serve"]
    assert mounts[1] == Mount("/dev/shm", "/", "tmpfs")


@pytest.mark.parametrize(
    ("path", "text", "why"),
    [
        ("/dev/shm/cache/triton", MOUNTINFO, "on tmpfs (/dev/shm)"),
        ("/tmp/torchinductor_kimi", MOUNTINFO, "PrivateTmp"),
        ("/var/cache/kimi-serve", CONTAINER, "container's own writable layer"),
    ],
)
def test_what_does_not_outlive_the_unit_is_named(path: str, text: str, why: str) -> None:
    found = caches.not_persistent(path, caches.parse_mountinfo(text))
    assert found is not None and why in found


@pytest.mark.parametrize("path", ["/var/cache/kimi serve/nv", "/var/lib/kimi-serve/cache", "/dev"])
def test_a_disk_is_persistent(path: str) -> None:
    assert caches.not_persistent(path, caches.parse_mountinfo(MOUNTINFO)) is None


def test_a_longer_mount_point_wins_but_not_a_mere_prefix() -> None:
    mounts = caches.parse_mountinfo(MOUNTINFO)
    assert caches.mount_of("/dev/shmem", mounts) == mounts[0]
    assert caches.mount_of("/dev/shm/x", mounts) == mounts[1]


def _real_tmpfs() -> Path:
    shm = Path("/dev/shm")
    m = caches.mount_of(str(shm), caches.read_mounts())
    if m is None or m.fstype != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm on this host")
    return shm


def test_a_cache_on_a_real_tmpfs_is_warned(tmp_path: Path) -> None:
    shm = _real_tmpfs()
    on_tmpfs = shm / f"kimi-serve-test-{os.getpid()}"
    found = caches.problems(
        {"triton": str(on_tmpfs / "triton"), "inductor": str(tmp_path / "inductor")},
        caches.read_mounts(),
    )
    assert len(found) == 1, found
    assert found[0].startswith(f"cache triton ({on_tmpfs}/triton): not persistent: on tmpfs")


def test_not_a_directory_and_not_absolute_are_warned(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    found = caches.problems(
        {"a": str(tmp_path / "file"), "b": "relative/dir", "c": str(tmp_path / "new" / "dir")},
        caches.read_mounts(),
    )
    assert found == [
        f"cache a ({tmp_path}/file): exists but is not a directory",
        "cache b (relative/dir): not an absolute path; it would follow SGLang's working directory",
    ]


def _config(tmp_path: Path, cache_dir: Path) -> Path:
    doc = {
        "sglang": {"python": "/usr/bin/python3", "model_path": str(tmp_path)},
        "state_dir": str(tmp_path / "state"),
        "warm": {"cache_dir": str(cache_dir)},
    }
    path = tmp_path / "kimi-serve.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_check_and_preflight_warn_of_a_cache_on_tmpfs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shm = _real_tmpfs()
    path = _config(tmp_path, shm / f"kimi-serve-test-{os.getpid()}")
    assert cli.main(["check", "--config", str(path)]) == 0  # a warning, not an error
    err = capsys.readouterr().err
    assert "warning: warm.cache_dir: cache sglang (" in err and "not persistent: on tmpfs" in err
    check = preflight.check_caches(config.load(str(path)))
    assert check.ok and check.warning and check.status == "WARN"
    assert "not persistent: on tmpfs (/dev/shm)" in check.message


def test_preflight_passes_a_cache_on_disk(tmp_path: Path) -> None:
    check = preflight.check_caches(config.load(str(_config(tmp_path, tmp_path / "cache"))))
    assert check.ok and not check.warning, check


def test_prepare_makes_the_directories_and_measures_them(tmp_path: Path) -> None:
    warm = tmp_path / "triton"
    (warm / "ab").mkdir(parents=True)
    (warm / "ab" / "kernel.cubin").write_bytes(b"x" * 1000)
    (warm / "top.json").write_bytes(b"y" * 24)
    report = caches.prepare({"triton": str(warm), "inductor": str(tmp_path / "cold" / "ind")})
    assert report["triton"] == {
        "path": str(warm),
        "existed": True,
        "bytes": 1024,
        "files": 2,
        "truncated": False,
    }
    cold = report["inductor"]
    assert (cold["existed"], cold["bytes"], cold["files"]) == (False, 0, 0)
    assert (tmp_path / "cold" / "ind").is_dir()
    assert (tmp_path / "cold" / "ind").stat().st_mode & 0o777 == 0o700


def test_warm_section_defaults_and_yaml_off() -> None:
    text = "sglang: {python: /p, model_path: /m}\nstate_dir: /srv/state\nwarm: {prewarm: off}\n"
    env = dict(os.environ)
    os.environ.pop("CACHE_DIRECTORY", None)
    try:
        cfg = config.parse(text, "x.yaml")
        os.environ["CACHE_DIRECTORY"] = "/var/cache/kimi-serve:/other"
        under_systemd = config.parse(text, "x.yaml")
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert cfg.warm.cache_dir == "/srv/state/cache" and cfg.warm.prewarm == "off"
    assert under_systemd.warm.cache_dir == "/var/cache/kimi-serve"
    with pytest.raises(config.ConfigError) as bad:
        config.parse(text.replace("prewarm: off", "prewarm: always"), "x.yaml")
    assert "x.yaml:3: warm.prewarm: 'always' is not one of auto, off" in bad.value.render()


# ------------------------------------------------------------------ who may write them

OTHER_USER = "kimi-serve-test-other"


def test_a_cache_dir_of_another_user_is_refused_by_check_preflight_and_the_daemon(
    tmp_path: Path,
) -> None:
    """Root's SGLang would load compiled kernels from directories that user can replace."""
    other = system_user(OTHER_USER)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    os.chown(cache, other.pw_uid, other.pw_gid)
    path = _config(tmp_path, cache)
    done = kimi_serve("check", "--config", str(path))
    assert done.returncode == 78, done.stderr
    line = f"{path}:{config.load(str(path)).key_lines['warm.cache_dir']}: warm.cache_dir: "
    assert line in done.stderr and f"belongs to uid {other.pw_uid}" in done.stderr, done.stderr
    check = preflight.check_caches(config.load(str(path)))
    assert not check.ok and f"{cache} belongs to uid {other.pw_uid}" in check.message, check
    run = kimi_serve("run", "--config", str(path))
    assert run.returncode == 78 and "warm.cache_dir" in run.stderr, run.stderr
    # Made root's again, the same directory passes.
    os.chown(cache, 0, 0)
    assert kimi_serve("check", "--config", str(path)).returncode == 0


@pytest.mark.parametrize(
    ("mode", "why"),
    [(0o777, "writable by every user"), (0o775, "writable by group")],
)
def test_a_cache_dir_others_may_write_is_refused(tmp_path: Path, mode: int, why: str) -> None:
    other = system_user(OTHER_USER)
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chown(cache, 0, other.pw_gid)  # a group the service user (root here) is not in
    cache.chmod(mode)
    done = kimi_serve("check", "--config", str(_config(tmp_path, cache)))
    assert done.returncode == 78 and why in done.stderr, done.stderr


def test_a_sticky_parent_is_no_problem_but_a_link_to_a_foreign_dir_is(tmp_path: Path) -> None:
    other = system_user(OTHER_USER)
    uids, gids = frozenset({0}), frozenset({0})
    # /tmp-like: 1777 above a directory of our own (the daemon makes a missing one 0700).
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert caches.owner_problem(str(sticky / "cache"), uids, gids) is None
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, other.pw_uid, other.pw_gid)
    (tmp_path / "link").symlink_to(foreign)
    assert "belongs to uid" in (caches.owner_problem(str(tmp_path / "link"), uids, gids) or "")
