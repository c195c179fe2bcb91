"""What the benches share: processes that are always cleaned up, a notify socket, a log
follower, the serving watcher, statistics, the daemon's event times; for the GPU benches the
holder processes, their launcher, the simulated NVML switch, a sampler and the checks' verdict.

All times are wall-clock seconds (`time.time()`): the daemons stamp their logs with wall
time, and everything runs on one machine, so a kill, a log line and a datagram compare
directly.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import yaml

from testkit import DaemonProcess
from testkit.wait import wait_until as kit_wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]
PYTHON = Path(sys.executable)
# Every process the bench starts, and everything those start, inherits this variable; the
# final sweep kills whatever still carries this run's value. It names the bench's pid, so a
# later run can also remove what a SIGKILLed run (which could not clean up) left behind.
MARKER = "KIMI_BENCH_RUN"
RUN_ID = f"{os.getpid()}:{uuid.uuid4().hex[:12]}"


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "KIMI_SERVE_CONFIG"):
        env.pop(name, None)
    env[MARKER] = RUN_ID
    env["PYTHONPATH"] = repo_path(env)
    env.update(extra or {})
    return env


def repo_path(env: Mapping[str, str]) -> str:
    """PYTHONPATH: the repository first, then whatever `env` had (a GPU host's carried wheels)."""
    return os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)


class Procs:
    """Every process the bench starts goes through here; `cleanup()` leaves none behind."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[Any]] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(
        self,
        argv: Sequence[str | os.PathLike[str]],
        *,
        env: Mapping[str, str] | None = None,
        stdout: Any = subprocess.DEVNULL,
        stderr: Any = subprocess.DEVNULL,
        text: bool = False,
    ) -> subprocess.Popen[Any]:
        with self._lock:
            # Once clean-up began (Ctrl-C, or the end of the run), a scenario still running
            # in another thread must not start anything the sweep would miss.
            if self._closed:
                raise BenchError("the bench is shutting down")
            proc = subprocess.Popen(
                [os.fspath(a) for a in argv],
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                env=base_env(env),
                cwd=REPO_ROOT,
                text=text,
                start_new_session=True,
            )
            self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[Any], timeout: float = 15.0) -> None:
        """SIGTERM, wait, then SIGKILL its process group."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)

    def cleanup(self) -> list[str]:
        """Stop everything started here, then sweep by marker. Returns what had to be killed
        by the sweep (should be empty)."""
        with self._lock:
            self._closed = True
            procs = list(self._procs)
        for proc in reversed(procs):
            self.stop(proc, timeout=10.0)
        return sweep_marked()


def sweep_marked(stale: bool = False) -> list[str]:
    """Kill the live processes of this run (with `stale`: those of earlier runs whose bench is
    gone); what was killed."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        with contextlib.suppress(psutil.Error):
            value = proc.environ().get(MARKER)
            if value is None or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if stale:
                owner = value.partition(":")[0]
                if value != RUN_ID and owner.isdigit() and not psutil.pid_exists(int(owner)):
                    found.append(proc)
            elif value == RUN_ID:
                found.append(proc)
    names = []
    for proc in found:
        with contextlib.suppress(psutil.Error):
            names.append(f"{proc.pid} {' '.join(proc.cmdline())[:100]}")
            proc.kill()
    psutil.wait_procs(found, timeout=5)
    return names


# ---------------------------------------------------------------------------- notify socket


class NotifySocket:
    """A unix datagram socket passed as NOTIFY_SOCKET. Every datagram is kept with the time the
    kernel queued it (SO_TIMESTAMPNS), so the bench's own thread scheduling never adds to it."""

    _SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; Python lacks the name

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, self._SO_TIMESTAMPNS, 1)
        self.messages: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(16))
            except OSError:
                return
            now = time.time()
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == self._SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", raw[:16])
                    now = sec + nsec / 1e9
            with self._cond:
                self.messages.append((now, data.decode("utf-8", "replace")))
                self._cond.notify_all()

    def wait(
        self, pred: Callable[[str], bool], after: float, timeout: float
    ) -> tuple[float, str] | None:
        """The first datagram received after `after` that matches."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for t, msg in self.messages:
                    if t >= after and pred(msg):
                        return t, msg
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def count(self, pred: Callable[[str], bool], after: float = 0.0) -> int:
        with self._cond:
            return sum(1 for t, m in self.messages if t >= after and pred(m))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def is_ready_msg(msg: str) -> bool:
    return "READY=1" in msg.split("\n")


# ---------------------------------------------------------------------------- log following


def json_event(line: str) -> dict[str, Any] | None:
    """A JSON log line as an event, with the time it arrived under `_arrived`."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if isinstance(doc, dict):
        doc["_arrived"] = time.time()
        return doc
    return None


class Lines:
    """Follows lines (a process's stdout) in a thread: `parse` turns one into an event (None:
    not one; JSON lines by default), `skip` drops lines cheaply before parsing."""

    def __init__(
        self,
        stream: Any,
        skip: Callable[[str], bool] | None = None,
        parse: Callable[[str], Any] = json_event,
    ) -> None:
        self.events: list[Any] = []
        self.raw_tail: list[str] = []
        self.skipped = 0
        self._skip, self._parse = skip, parse
        self._cond = threading.Condition()
        self._eof = False
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            if self._skip is not None and self._skip(line):
                self.skipped += 1
                continue
            doc = self._parse(line)
            with self._cond:
                self.raw_tail.append(line)
                del self.raw_tail[:-40]
                if doc is not None:
                    self.events.append(doc)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait(self, pred: Callable[[Any], bool], timeout: float, start: int = 0) -> tuple[int, Any]:
        """(index, event) of the first event from index `start` on that matches."""
        deadline = time.monotonic() + timeout
        with self._cond:
            i = start
            while True:
                while i < len(self.events):
                    if pred(self.events[i]):
                        return i, self.events[i]
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    what = "ended" if self._eof else f"gave nothing matching in {timeout:g} s"
                    raise BenchError(f"the log {what}; last lines: {''.join(self.raw_tail[-8:])}")
                self._cond.wait(left)

    def find(self, pred: Callable[[dict[str, Any]], bool], start: int = 0) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self.events[start:] if pred(e)]

    def __len__(self) -> int:
        with self._cond:
            return len(self.events)


class BenchError(RuntimeError):
    """A scenario could not be measured; the message says why."""


# ---------------------------------------------------------------------------- serving watcher


class Observer:
    """Runs bench/observe.py (see there) as a process; `prefix` runs it elsewhere (nsenter)."""

    def __init__(
        self,
        procs: Procs,
        port: int,
        *,
        fresh: bool = True,
        mode: str = "serve",
        window: float = 20.0,
        decode_timeout: float = 3.0,
        readyz: str | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        argv = [*prefix, str(PYTHON), "-m", "bench.observe", "--port", str(port)]
        argv += ["--mode", mode, "--window", str(window)]
        argv += ["--decode-timeout", str(decode_timeout)]
        self.readyz = readyz
        if readyz:
            argv += ["--readyz", readyz]
        if fresh:
            argv.append("--fresh")
        self.proc = procs.start(argv, stdout=subprocess.PIPE, text=True)
        self.lines = Lines(self.proc.stdout)
        self.lines.wait(lambda e: e.get("event") == "started", 10.0)

    def event(self, *names: str, timeout: float) -> dict[str, Any]:
        """The first of the named events (or `timeout`, which raises)."""
        ev: dict[str, Any] = self.lines.wait(
            lambda e: e.get("event") in (*names, "timeout"), timeout
        )[1]
        if ev.get("event") == "timeout":
            raise BenchError(f"the watcher gave up waiting for {'/'.join(names)}")
        return ev

    def served(self, timeout: float) -> dict[str, Any]:
        """{"bind": t, "decode": t}, with --readyz also "readyz": when the daemon's /readyz first
        answered 200 (polled from the bind on; None: not within 10 s); then the watcher is
        closed."""
        try:
            self.event("decode", timeout=timeout)
            done = self.lines.find(lambda e: e.get("event") in ("bind", "decode"))
            out: dict[str, Any] = {e["event"]: float(e["t"]) for e in done}
            if self.readyz:
                try:
                    out["readyz"] = float(self.event("readyz", "readyz_timeout", timeout=10)["t"])
                except BenchError:
                    out["readyz"] = None
            return out
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


# ---------------------------------------------------------------------------- small helpers


def wait_until(
    pred: Callable[[], Any], timeout: float, interval: float = 0.01, what: str = "condition"
) -> Any:
    """testkit.wait_until, failing as a BenchError (a bench row says what did not happen)."""
    try:
        return kit_wait_until(pred, timeout, what, interval)
    except AssertionError as exc:
        raise BenchError(f"{what}: not true within {timeout:g} s") from exc


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


class Sampler(threading.Thread):
    """`read()` every `interval` seconds on its own thread: (`clock()`, value) pairs."""

    def __init__(
        self,
        read: Callable[[], Any],
        interval: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(daemon=True)
        self.read, self.interval, self.clock = read, interval, clock
        self.samples: list[tuple[float, Any]] = []
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(Exception):
                self.samples.append((self.clock(), self.read()))
            self.done.wait(self.interval)

    def stop(self) -> None:
        self.done.set()
        self.join(2)

    def first(self, after: float, cond: Callable[[Any], bool]) -> float | None:
        """Seconds from `after` to the first sample from then on that satisfies `cond`."""
        return next((round(t - after, 3) for t, v in self.samples if t >= after and cond(v)), None)

    def between(self, t0: float, t1: float) -> float:
        """How much a growing value (CPU seconds) grew over [t0, t1] (nearest samples)."""
        if not self.samples:
            return float("nan")
        a = min(self.samples, key=lambda s: abs(s[0] - t0))
        b = min(self.samples, key=lambda s: abs(s[0] - t1))
        span = b[0] - a[0]
        return (b[1] - a[1]) / span * (t1 - t0) if span > 0 else float("nan")


# ---------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Stat:
    n: int
    median: float
    lo: float  # minimum
    hi: float  # maximum

    @classmethod
    def of(cls, values: Iterable[float]) -> Stat | None:
        v = sorted(x for x in values if x == x)  # drop NaN
        if not v:
            return None
        return cls(len(v), statistics.median(v), v[0], v[-1])


def kill_now(procs: Procs, pid: int) -> tuple[float, Callable[[float], float]]:
    """SIGKILL `pid` from a single-threaded helper process (bench/observe.py --mode kill),
    which also watches a pidfd for the moment the process has exited. In the bench process
    itself a thread could wait up to the interpreter's 5-ms switch interval for the GIL
    between reading the clock and sending the signal, or before noting the exit.

    Returns (kill time, a function that waits for and returns the exit time)."""
    helper = procs.start(
        [str(PYTHON), "-m", "bench.observe", "--mode", "kill", "--pid", str(pid), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    lines = Lines(helper.stdout)
    _, ev = lines.wait(lambda e: e.get("event") in ("killed", "error"), 15.0)
    if ev.get("event") == "error":
        raise BenchError(f"cannot kill {pid}: {ev.get('detail')}")

    def dead(timeout: float) -> float:
        _, end = lines.wait(lambda e: e.get("event") in ("dead", "error"), timeout)
        helper.wait(5)
        if end.get("event") != "dead":
            raise BenchError(f"process {pid} did not exit: {end.get('detail')}")
        return float(end["t"])

    return float(ev["t"]), dead


# ---------------------------------------------------------------------------- event times


def at(event: Mapping[str, Any]) -> float:
    """Unix time of one of the daemon's JSON log lines (its `timestamp`: structlog's ISO stamp,
    UTC, microseconds)."""
    return dt.datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def state_is(to: str) -> Callable[[Mapping[str, Any]], bool]:
    """Matches the daemon's `state` log event into state `to`."""
    return lambda e: e.get("event") == "state" and e.get("new") == to


def write_yaml(path: Path, doc: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(doc)))
    return path


def start_daemon(work: Path, cfg: dict[str, Any]) -> DaemonProcess:
    """`kimi-serve run` on `cfg` (testkit.DaemonProcess: its JSON log lines as it prints them),
    in this environment less NOTIFY_SOCKET."""
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    return DaemonProcess.start(write_yaml(work / "kimi-serve.yaml", cfg), cfg, env)


# ---------------------------------------------------------------------------- GPU benches
# What bench/gpu_leftovers.py, gpu_fitness.py and gpu_multi.py share: the holder processes (a
# GPU allocation with torch, or a simulated one), started as orphans through a launcher that
# exits at once, as SGLang's schedulers are when the daemon above them dies; the simulated
# NVML for runs without a GPU; a sampler; the way a run ends.

MiB = 1 << 20

# argv: GIB MODE TITLE...; MODE "-", "ignore-term" or "nccl" (env BENCH_RANK/WORLD/PORT).
# Reports "pid result" on BENCH_READY_FD once its memory is taken (and the all-reduce done).
HOLDER = r"""
import os, signal, sys
gib, mode = float(sys.argv[1]), sys.argv[2]
result = "-"
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if not os.environ.get("KIMI_SERVE_SIMULATED_GPUS"):
    import torch
    if mode == "nccl":
        import torch.distributed as dist
        rank, world = int(os.environ["BENCH_RANK"]), int(os.environ["BENCH_WORLD"])
        dist.init_process_group(
            "nccl", init_method="tcp://127.0.0.1:" + os.environ["BENCH_PORT"],
            rank=rank, world_size=world, device_id=torch.device("cuda", 0))
        t = torch.full((1 << 20,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        result = "%g" % t[0].item()
    if gib > 0:
        x = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
fd = int(os.environ["BENCH_READY_FD"])
os.write(fd, ("%d %s\n" % (os.getpid(), result)).encode())
os.close(fd)
while True:
    signal.pause()
"""
# Starts each [argv, env] in a session of its own and exits: the holders become orphans.
LAUNCHER = r"""
import json, os, subprocess, sys
fd = int(os.environ["BENCH_READY_FD"])
for argv, env in json.loads(sys.argv[1]):
    subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True, pass_fds=(fd,),
                     stdin=subprocess.DEVNULL)
"""


def simulate_gpus(count: int) -> dict[str, str]:
    """Switch this process (and what it starts) to the simulated NVML with `count` GPUs; every
    simulated process holds 1 GiB. Returns the environment for the holders."""
    os.environ.update(
        KIMI_SERVE_SIMULATED_GPUS=str(count),
        KIMI_SERVE_SIM_TAG=f"bench-{uuid.uuid4().hex[:8]}",
        KIMI_SERVE_SIMULATED_GPU_MIB="1024",
    )
    return dict(os.environ)


class Scene(NamedTuple):
    holder: Path  # the holder script, written out
    state: Path  # the dead daemon's state directory (its launch record goes here)
    marker: str  # the owner marker of a daemon with that state directory
    work: Path


def scene(prefix: str) -> Scene:
    """What a SIGKILLed daemon leaves behind: a work directory, its state directory and the
    owner marker derived from it; the holder script beside them."""
    from supervisor.process.identity import owner_marker

    work = Path(tempfile.mkdtemp(prefix=prefix))
    holder = work / "holder.py"
    holder.write_text(HOLDER)
    state = work / "state"
    state.mkdir()
    return Scene(holder, state, owner_marker(str(state)), work)


def holder_argv(
    holder: Path, gib: float, title: Sequence[str], mode: str = "-", sim_gpu: int | None = None
) -> list[str]:
    """A holder's command line; simulated, one that holds memory is listed on GPU `sim_gpu`."""
    argv = [str(PYTHON), str(holder), str(gib), mode]
    if sim_gpu is not None and gib > 0 and os.environ.get("KIMI_SERVE_SIMULATED_GPUS"):
        argv += ["--sim-gpu", str(sim_gpu)]
    return argv + list(title)


@dataclass(frozen=True)
class Held:
    ident: Any  # supervisor.process.identity.ProcessIdentity
    result: str  # what the holder reported ("-", or the all-reduce's value)
    ppid: int  # its parent once the launcher had exited


def launch_orphans(
    jobs: Sequence[tuple[list[str], Mapping[str, str]]], env: Mapping[str, str], timeout: float
) -> list[Held]:
    """Start every (argv, extra env) job as an orphan; one Held per job, in job order."""
    from supervisor.process.identity import identity_of

    r, w = os.pipe()
    launcher = subprocess.Popen(
        [str(PYTHON), "-c", LAUNCHER, json.dumps([[a, dict(e)] for a, e in jobs])],
        env={**env, "BENCH_READY_FD": str(w)},
        pass_fds=(w,),
    )
    os.close(w)
    launcher.wait()
    got: dict[int, str] = {}
    buf = b""
    deadline = time.monotonic() + timeout
    with os.fdopen(r, "rb", buffering=0) as pipe:
        while len(got) < len(jobs):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                raise BenchError(f"only {len(got)} of {len(jobs)} holders became ready")
            chunk = pipe.read(4096)
            if not chunk:
                raise BenchError(f"holders exited early: {len(got)} of {len(jobs)} ready")
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                number, result = line.decode().split()
                got[int(number)] = result
    out: dict[int, Held] = {}
    for pid, result in got.items():
        proc = psutil.Process(pid)
        index = next(i for i, (argv, _e) in enumerate(jobs) if argv == proc.cmdline())
        ident = identity_of(pid)
        if ident is None:
            raise BenchError(f"holder {pid} is gone")
        out[index] = Held(ident, result, proc.ppid())
    return [out[i] for i in range(len(jobs))]


def kill_held(held: Iterable[Held]) -> None:
    from supervisor.process.identity import signal_identity

    for h in held:
        signal_identity(h.ident, signal.SIGKILL)


def write_json(out: str | Path, name: str, doc: Any) -> None:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(json.dumps(doc, indent=1, default=str))


def verdict(checks: Mapping[str, bool]) -> int:
    """Print a line per check; 0 when every check held."""
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


def parser(
    name: str, doc: str | None, *, rounds: int | None = None, json_out: bool = False
) -> argparse.ArgumentParser:
    """The command line of `python -m bench NAME`, its module docstring as its help; with
    `rounds`, --rounds (that the default); with `json_out`, --json FILE."""
    ap = argparse.ArgumentParser(
        prog=f"python -m bench {name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds)
    if json_out:
        ap.add_argument("--json", type=Path, help="also write the results here as JSON")
    return ap


def gpu_args(name: str, doc: str, gib_help: str, *, index: bool = True) -> argparse.ArgumentParser:
    """The GPU benches' shared options."""
    ap = parser(name, doc)
    if index:
        ap.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU to use")
    ap.add_argument("--gib", type=float, default=4.0, help=gib_help)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where the JSON goes")
    ap.add_argument("--simulated", action="store_true", help="no GPU: the simulated NVML")
    return ap


def run_gpu_bench(main_async: Callable[[argparse.Namespace], Any], args: Any) -> int:
    """The bench's loop; NVML missing is one line and exit 1, never a traceback."""
    import asyncio

    from supervisor.gpu.nvml import NvmlUnavailable

    try:
        return int(asyncio.run(main_async(args)))
    except (NvmlUnavailable, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


class Gpu:
    """NVML's view of one GPU, read directly (cheap enough to sample every 10 ms): the real
    one, or the simulation (--simulated)."""

    def __init__(self, index: int, simulated: bool) -> None:
        self.simulated = simulated
        self.index = index
        if simulated:
            from supervisor.gpu.sim import SimulatedNvml

            self.sim = SimulatedNvml.from_env(os.environ)
            self.uuid = self.sim.snapshot()[index].uuid
            self.name, self.driver = "simulated", "-"
        else:
            import pynvml

            self.nv = pynvml
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.uuid = str(pynvml.nvmlDeviceGetUUID(self.handle))
            self.name = str(pynvml.nvmlDeviceGetName(self.handle))
            self.driver = str(pynvml.nvmlSystemGetDriverVersion())

    def read(self) -> tuple[int, dict[int, int | None]]:
        """(memory used, {pid: bytes or None}) as NVML lists them now."""
        if self.simulated:
            snap = self.sim.snapshot()[self.index]
            return snap.memory_used_bytes, {p.pid: p.used_bytes for p in snap.processes}
        nv = self.nv
        used = int(nv.nvmlDeviceGetMemoryInfo(self.handle, version=nv.nvmlMemory_v2).used)
        procs = nv.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return used, {int(p.pid): p.usedGpuMemory for p in procs}

    def usage(self) -> dict[str, Any]:
        """Memory used and NVML's processes now, in MiB (None: NVML gave no size)."""
        used, procs = self.read()
        return {
            "used_mib": round(used / MiB),
            "processes": {str(p): None if b is None else round(b / MiB) for p, b in procs.items()},
        }

    def machine(self) -> dict[str, Any]:
        return {
            "gpu": self.name,
            "uuid": self.uuid,
            "driver": self.driver,
            "host_cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "simulated": self.simulated,
        }

    def pin(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with CUDA pinned to this GPU whatever CUDA's own device order is."""
        return {**env, "CUDA_VISIBLE_DEVICES": self.uuid, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
