"""The launch record as an attacker writes it: the service user forges `launch.json`, root runs
`kimi-serve gpu-clean` (the real command, as a process), and nobody else's process may die.

Real users: the service user is created with useradd (`testkit.users`), the bystanders run as
root and as `nobody`. Real processes hold simulated GPU memory (`supervisor.gpu.sim`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.gpu import sim as gpu_sim
from supervisor.gpu import sweep_leftovers
from supervisor.process import ProcessOwner
from supervisor.process.identity import RECORD_FILE, ProcessIdentity, live_process
from testkit import BIN
from testkit.gpu import Procs
from testkit.users import system_user

NOBODY = 65534
# World-readable: an attacker knows the running boot's id as well as the daemon does.
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
SERVICE_USER = "kimi-serve-test"


@pytest.fixture
def service_uid() -> int:
    return system_user(SERVICE_USER).pw_uid


@pytest.fixture
def state(service_uid: int) -> Iterator[Path]:
    """The service user's state directory, as systemd's StateDirectory= makes it; under a
    directory the other users can reach (pytest's own tmp_path is root's alone)."""
    top = Path(tempfile.mkdtemp(prefix="kimi-serve-records-"))
    try:
        os.chmod(top, 0o755)
        d = top / "state"
        d.mkdir(mode=0o750)
        os.chown(d, service_uid, service_uid)
        yield d
    finally:
        shutil.rmtree(top)


def forge(
    state: Path, uid: int, processes: list[ProcessIdentity], boot: str | None = None, mode: int = 0
) -> Path:
    """launch.json written by `uid` itself (a process running as that user), as the record of
    a dead daemon listing `processes`."""
    doc = {
        "daemon_pid": 999_999_999,
        "profile": "primary",
        "boot_id": BOOT_ID.read_text().strip() if boot is None else boot,
        "processes": [{"pid": p.pid, "create_time": p.create_time} for p in processes],
    }
    path = state / RECORD_FILE
    write = (
        "import os, sys; open(sys.argv[1], 'w').write(sys.argv[2]); "
        "os.chmod(sys.argv[1], int(sys.argv[3]))"
    )
    subprocess.run(
        ["/usr/bin/python3", "-c", write, str(path), json.dumps(doc), str(mode or 0o600)],
        user=uid,
        group=uid,
        extra_groups=[],
        check=True,
    )
    return path


def gpu_clean(state: Path, procs: Procs) -> tuple[int, str]:
    """Root's `kimi-serve gpu-clean` against the simulated GPUs."""
    cfg = state.parent / "kimi-serve.yaml"
    cfg.write_text(
        f"sglang: {{model_path: /models/kimi}}\nstate_dir: {state}\n"
        "gpus:\n  memory_free_timeout: 500ms\n"
    )
    env = {**procs.env, gpu_sim.ENV_GPUS: "2"}
    done = subprocess.run(
        [str(BIN), "gpu-clean", "--config", str(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    return done.returncode, done.stdout + done.stderr


def alive(ident: ProcessIdentity) -> bool:
    return live_process(ident) is not None


def test_a_forged_record_does_not_make_roots_gpu_clean_kill_other_users_jobs(
    state: Path, service_uid: int, procs: Procs
) -> None:
    # Two jobs of other users on the GPUs, one whose command line even looks like SGLang's.
    roots = procs.start("train.py", "--sim-gpu", "0")
    nobodys = procs.start("sglang::scheduler_TP0", "--sim-gpu", "1", user=NOBODY)
    # And the service user's own leftover, which the record rightly lists.
    leftover = procs.start("sglang::scheduler_TP1", "--sim-gpu", "1", user=service_uid)
    forge(state, service_uid, [roots, nobodys, leftover])

    code, text = gpu_clean(state, procs)

    assert alive(roots) and alive(nobodys), text
    assert not alive(leftover), text
    assert f"lists pid {roots.pid}, which runs as uid 0, not the service user's uid" in text
    assert f"lists pid {nobodys.pid}, which runs as uid {NOBODY}" in text
    assert code == 1  # the other users' memory is still there, and said to be
    assert "foreign" in text


def test_a_record_from_another_boot_is_ignored(state: Path, service_uid: int, procs: Procs) -> None:
    # The service user's job that no gpus.match entry hits and no marker names: after a reboot,
    # a pid in an old record is just a number handed out afresh.
    job = procs.start("notebook.py", "--sim-gpu", "0", user=service_uid)
    forge(state, service_uid, [job], boot="0f0f0f0f-0000-4000-8000-000000000000")

    code, text = gpu_clean(state, procs)

    assert alive(job), text
    assert "was written in another boot (boot id 0f0f0f0f-0000-4000-8000-000000000000" in text
    assert "0 recorded from earlier launches" in text
    assert code == 1


@pytest.mark.parametrize(
    ("writer", "mode", "why"),
    [
        ("service", 0o666, "is mode 0666: group or others may write it"),
        ("nobody", 0o600, f"belongs to uid {NOBODY}, not the service user's uid"),
    ],
)
def test_a_record_with_an_unsafe_owner_or_mode_is_ignored_with_a_warning(
    state: Path, service_uid: int, procs: Procs, writer: str, mode: int, why: str
) -> None:
    job = procs.start("notebook.py", "--sim-gpu", "0", user=service_uid)
    os.chmod(state, 0o777 if writer == "nobody" else 0o750)  # so that nobody can write there
    forge(state, service_uid if writer == "service" else NOBODY, [job], mode=mode)

    code, text = gpu_clean(state, procs)

    assert alive(job), text
    assert f"warning: {state / RECORD_FILE} {why}" in text
    assert code == 1


def test_a_record_with_a_number_of_hundreds_of_digits_is_no_record(
    state: Path, service_uid: int, procs: Procs
) -> None:
    # float() of a 401-digit integer raises OverflowError, which no reader expected: root's
    # gpu-clean ended with a traceback. Now it is a file that is not a launch record.
    job = procs.start("notebook.py", "--sim-gpu", "0", user=service_uid)
    forge(state, service_uid, [ProcessIdentity(job.pid, 10**400)])

    code, text = gpu_clean(state, procs)

    assert alive(job), text
    assert f"warning: {state / RECORD_FILE} is not a launch record: ignored" in text, text
    assert code == 1


def test_a_listed_process_without_gpu_memory_or_evidence_is_not_killed(
    state: Path, service_uid: int, procs: Procs
) -> None:
    bystander = procs.start("editor", user=service_uid)  # no GPU memory, no marker, no match
    detok = procs.start("sglang::detokenizer", user=service_uid)  # no GPU memory, but a match
    forge(state, service_uid, [bystander, detok])

    code, text = gpu_clean(state, procs)

    assert alive(bystander), text
    assert not alive(detok), text
    assert "holds no GPU memory and shows no sign of being ours" in text
    assert code == 0, text


async def test_the_daemons_sweep_spares_another_users_recorded_process(procs: Procs) -> None:
    # The daemon's own cleaning at start (host.clean -> sweep_leftovers), running as root as a
    # pod's container does: a record naming nobody's job kills nothing of it.
    victim = procs.start("sglang::scheduler_TP0", user=NOBODY)
    owner = ProcessOwner("/nonexistent/owner", lambda _l, _s, _x: None, lambda _c: None)
    report = await sweep_leftovers(
        owner.sweep, None, {victim}, owner.evident({victim}), match=("sglang",)
    )
    assert alive(victim)
    assert report.processes == [] and report.spared
    assert f"pid {victim.pid}: listed in the launch record but runs as" in report.spared[0]
