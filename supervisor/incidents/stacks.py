"""Stacks of a live, broken SGLang, taken with py-spy before it is killed.

A hang is evidence only while the process is alive: once SIGKILLed, nobody can tell *where* it
hung. So before the kill of a hung, timed-out or fatally-logging launch, every live process of it
is dumped with `py-spy dump` (native frames too where py-spy can unwind them), all in parallel,
the whole capture bounded by one budget (`incidents.dump_timeout`). After the budget every py-spy
still running is killed with its process group and the caller goes on: the kill of SGLang never
waits for py-spy. SGLang's own watchdog dumps only after 300 s and is reported failing where
py-spy is not installed (sglang #7783, #7553); here py-spy is a dependency of kimi-serve.

Privilege. py-spy reads another process's memory (process_vm_readv) and pauses it with ptrace.
The kernel allows that for a process of the same user holding no capability the tracer lacks;
Yama's `ptrace_scope=1` (Ubuntu's default) further limits it to descendants, and py-spy started
by the daemon is SGLang's sibling. CAP_SYS_PTRACE lifts both. Under the shipped unit the daemon
holds it (AmbientCapabilities=CAP_SYS_PTRACE, docs/systemd.md); `confine()` keeps it from
SGLang, and `_spawn` raises it for py-spy alone. Without it the dump fails with EPERM and the
incident says so.

Pure parts (classifying py-spy's answer, parsing and rendering stacks) are separate from the
effects (spawning and killing py-spy), so any pid list can be captured: the stand-in's, a real
SGLang's, a test's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# Why a process has no stack (the words incident.json and `kimi-serve incidents show` use).
NO_PRIVILEGE = "no_privilege"
PY_SPY_MISSING = "py_spy_missing"
TIMED_OUT = "timed_out"
PROCESS_GONE = "process_gone"
FAILED = "failed"

# A tp=8 scheduler with torch's thread pools has a few hundred threads; its native dump is
# well under 1 MiB. Anything beyond this is cut, with a note.
MAX_OUTPUT_BYTES = 4 * 2**20

# The share of the budget a native dump may use before the Python-only one is tried instead.
NATIVE_SHARE = 0.6

_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_RAISE, _PR_CAP_AMBIENT_LOWER, _PR_CAP_AMBIENT_CLEAR_ALL = 2, 3, 4
CAP_SYS_PTRACE = 19

# py-spy is a Rust program; its errors end in the OS error it met (`Permission denied (os error
# 13)` when /proc/PID/mem or process_vm_readv is refused, `Operation not permitted (os error 1)`
# when ptrace is: no capability, Yama, or a seccomp filter answering EPERM).
_EPERM = re.compile(r"os error (1|13)\b|Permission denied|Operation not permitted|EPERM")
_GONE = re.compile(r"os error (2|3)\b|No such process|Check that the process is running")


def find_py_spy() -> str | None:
    """The py-spy installed with kimi-serve (next to its interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / "py-spy"  # the venv's bin, not the resolved python
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


# ------------------------------------------------------------------------ capabilities


def _prctl(*args: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(*args, *([0] * (5 - len(args)))))


def _caps(field_name: str) -> int:
    # The calling thread's own sets: capabilities are per thread in Linux.
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1], 16)
    return 0


def ptrace_capable() -> bool:
    """Whether this thread can hand CAP_SYS_PTRACE to a program it starts (py-spy)."""
    try:
        bit = 1 << CAP_SYS_PTRACE
        return bool(_caps("CapPrm") & bit and _caps("CapInh") & bit)
    except OSError:
        return False


def confine() -> None:
    """Programs started from now on by this thread (SGLang) get no ambient capability.

    Call once, first thing, on the thread that spawns SGLang (the event loop's). The daemon
    keeps CAP_SYS_PTRACE in its permitted and inheritable sets, so `_spawn` can raise it again
    for py-spy alone. Harmless where there is nothing to clear (no capability, not Linux).
    """
    with contextlib.suppress(OSError, AttributeError):
        _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)


@contextlib.contextmanager
def _ptrace_for_children() -> Iterator[None]:
    raised = False
    if ptrace_capable():
        with contextlib.suppress(OSError, AttributeError):
            raised = _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, CAP_SYS_PTRACE) == 0
    try:
        yield
    finally:
        if raised:
            with contextlib.suppress(OSError, AttributeError):
                _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_LOWER, CAP_SYS_PTRACE)


# ------------------------------------------------------------------------ results


@dataclass(frozen=True)
class ProcessStack:
    pid: int
    name: str  # the process title or command line, as ps shows it
    text: str  # py-spy's dump; on failure, what it said
    error: str | None = None  # one of the reasons above; None: `text` is the stack
    native: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Capture:
    stacks: tuple[ProcessStack, ...] = ()
    seconds: float = 0.0
    # Why there is no stack at all (py-spy missing, nothing alive, all refused...); None when
    # at least one process was dumped.
    reason: str | None = None
    py_spy: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return any(s.ok for s in self.stacks)

    def summary(self) -> dict[str, object]:
        """What incident.json records about the capture."""
        return {
            "taken": self.ok,
            "reason": self.reason,
            "seconds": round(self.seconds, 3),
            "py_spy": self.py_spy,
            "processes": [
                {
                    "pid": s.pid,
                    "name": s.name,
                    "ok": s.ok,
                    "error": s.error,
                    "native": s.native,
                    "seconds": round(s.seconds, 3),
                    **({} if s.ok else {"message": _last_line(s.text)}),
                }
                for s in self.stacks
            ],
        }


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # py-spy prints `Error: ...` then `Caused by:` and the OS error; the first says what failed.
    first = next((ln for ln in lines if ln.startswith("Error:")), lines[0] if lines else "")
    cause = next((ln for ln in lines if "os error" in ln), "")
    return f"{first} ({cause})" if cause and cause not in first else first


def classify(returncode: int, output: str, alive: bool) -> str | None:
    """py-spy's verdict on one process: None (a stack), or why there is none."""
    if returncode == 0 and "Thread " in output:
        return None
    if not alive or (_GONE.search(output) and not _EPERM.search(output)):
        return PROCESS_GONE
    if _EPERM.search(output):
        return NO_PRIVILEGE
    return FAILED


def overall_reason(stacks: Sequence[ProcessStack]) -> str | None:
    """One line for the incident when no process could be dumped."""
    if not stacks:
        return f"{PROCESS_GONE}: no live process of the launch was left to dump"
    if any(s.ok for s in stacks):
        return None
    kinds = {s.error for s in stacks}
    if kinds == {NO_PRIVILEGE}:
        return (
            f"{NO_PRIVILEGE}: py-spy was refused access to SGLang's processes (EPERM); the "
            "daemon needs CAP_SYS_PTRACE (AmbientCapabilities=CAP_SYS_PTRACE, docs/systemd.md)"
        )
    if kinds == {TIMED_OUT}:
        return f"{TIMED_OUT}: py-spy did not finish within incidents.dump_timeout"
    if kinds == {PROCESS_GONE}:
        return f"{PROCESS_GONE}: every process of the launch exited before it could be dumped"
    first = stacks[0]
    return f"{first.error}: {_last_line(first.text)}"


# ------------------------------------------------------------------------ effects


def _title(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        # One line: a `python -c` script or setproctitle's padding must not break stacks.txt.
        return " ".join(" ".join(proc.cmdline()).split())[:200] or proc.name()
    except (psutil.Error, OSError):
        return "?"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except (psutil.Error, OSError):
        return False


def _spawn(argv: list[str], out: int) -> subprocess.Popen[bytes]:
    # Synchronous on purpose: the ambient capability is raised, py-spy forked and the capability
    # lowered with no await in between, so nothing else the loop starts meanwhile (SGLang)
    # inherits it. Its own session: a py-spy that hangs is killed with everything it started.
    with _ptrace_for_children():
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )


async def _exited(popen: subprocess.Popen[bytes]) -> None:
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(popen.pid)
    except OSError:
        while popen.poll() is None:
            await asyncio.sleep(0.01)
        return
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    popen.wait()


async def _run(argv: list[str], deadline: float) -> tuple[int | None, str]:
    """Run py-spy until it ends or `deadline` (loop time); None for the code when killed."""
    # Output goes to an anonymous memory file, not a pipe: a pipe held open by something the
    # killed program started would keep a reader waiting for ever; and not to a file under
    # /tmp, which a sandbox may make read-only.
    out = os.memfd_create("py-spy-dump", os.MFD_CLOEXEC)
    try:
        popen = _spawn(argv, out)
        code: int | None
        try:
            async with asyncio.timeout_at(deadline):
                await _exited(popen)
            code = popen.returncode
        except TimeoutError:
            code = None
        finally:
            if popen.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(popen.pid, signal.SIGKILL)
                # SIGKILL ends it within milliseconds.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2.0):
                        await _exited(popen)
        os.lseek(out, 0, os.SEEK_SET)
        data = os.read(out, MAX_OUTPUT_BYTES + 1)
    finally:
        os.close(out)
    text = data[:MAX_OUTPUT_BYTES].decode("utf-8", "replace")
    if len(data) > MAX_OUTPUT_BYTES:
        text += f"\n[... cut at {MAX_OUTPUT_BYTES} bytes]\n"
    return code, text


async def _dump_one(pid: int, deadline: float, py_spy: str, native: bool) -> ProcessStack:
    started = time.monotonic()
    name = _title(pid)
    if not _alive(pid):
        return ProcessStack(pid, name, "", PROCESS_GONE)
    # Native frames show where a scheduler sits inside CUDA or NCCL (the cuModuleLoadData hang
    # of sglang #33642); py-spy cannot unwind every build, so a failed native dump is retried
    # without, inside the same budget.
    # Native unwinding reads the symbols of every loaded library (libtorch_cuda, NCCL: large),
    # so it gets part of the budget only; the Python-only dump keeps the rest.
    text = ""
    loop = asyncio.get_running_loop()
    # A stopped process (SIGSTOP, job control) cannot be paused again: py-spy's ptrace
    # interrupt meets the group stop and fails at once ("Failed to suspend process"). It cannot
    # change while stopped, so its memory is read as it is (--nonblocking: no native frames).
    stopped = _stopped(pid)
    for use_native in (True, False) if native and not stopped else (False,):
        argv = [py_spy, "dump", "--pid", str(pid)] + (["--native"] if use_native else [])
        argv += ["--nonblocking"] if stopped else []
        until = loop.time() + NATIVE_SHARE * (deadline - loop.time()) if use_native else deadline
        try:
            code, text = await _run(argv, until)
        except OSError as exc:  # cannot start it at all (fd limit, exec refused): no stack
            return ProcessStack(pid, name, f"Error: cannot run {py_spy}: {exc}", FAILED)
        spent = time.monotonic() - started
        if code is None and use_native and loop.time() < deadline:
            continue
        if code is None:
            return ProcessStack(pid, name, text, TIMED_OUT, use_native, spent)
        verdict = classify(code, text, _alive(pid))
        if verdict is None:
            return ProcessStack(pid, name, text, None, use_native, spent)
        if verdict in (NO_PRIVILEGE, PROCESS_GONE):
            return ProcessStack(pid, name, text, verdict, use_native, spent)
    return ProcessStack(pid, name, text, FAILED, False, time.monotonic() - started)


async def capture(
    pids: Sequence[int],
    timeout: float,
    *,
    py_spy: str | None = None,
    native: bool = True,
) -> Capture:
    """Dump every process in `pids` in parallel; returns within `timeout` (plus the few
    milliseconds a SIGKILLed py-spy takes to go), whatever py-spy does."""
    started = time.monotonic()
    binary = py_spy or find_py_spy()
    if binary is None or not os.access(binary, os.X_OK):
        return Capture(
            reason=f"{PY_SPY_MISSING}: no py-spy next to {sys.executable} or on PATH "
            "(it is a dependency of kimi-serve: reinstall the package)",
            py_spy=binary,
        )
    deadline = asyncio.get_running_loop().time() + timeout
    stacks = await asyncio.gather(*(_dump_one(p, deadline, binary, native) for p in pids))
    return Capture(
        stacks=tuple(stacks),
        seconds=time.monotonic() - started,
        reason=overall_reason(stacks),
        py_spy=binary,
    )


# ------------------------------------------------------------------------ text


def render(cap: Capture) -> str:
    """stacks.txt: every process's dump, or why it has none."""
    out = [f"# py-spy stacks taken before the kill ({cap.seconds:.2f} s, {cap.py_spy})"]
    if cap.reason:
        out.append(f"# no stacks: {cap.reason}")
    for s in cap.stacks:
        how = "native" if s.native else "python"
        head = f"=== pid {s.pid}: {s.name}"
        if s.ok:
            out.append(f"{head} ({how} frames, {s.seconds:.2f} s) ===")
            out.append(s.text.rstrip())
        else:
            out.append(f"{head}: no stack ({s.error}) ===")
            if s.text.strip():
                out.append(s.text.rstrip())
        out.append("")
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class Thread:
    header: str  # `Thread 123 (active): "MainThread"`
    active: bool
    frames: tuple[str, ...]  # innermost first, as py-spy prints them


@dataclass(frozen=True)
class ProcessDump:
    pid: int
    name: str
    error: str | None
    threads: tuple[Thread, ...]


_PROC_HEAD = re.compile(r"^=== pid (\d+): (.*?)(?:: no stack \((\w+)\))? (?:\(.*\) )?===$")
_THREAD = re.compile(r"^Thread \S+ \((\w+)\)")


def parse(text: str) -> list[ProcessDump]:
    """stacks.txt back into processes and threads (for `kimi-serve incidents show`)."""
    dumps: list[ProcessDump] = []
    cur: tuple[int, str, str | None] | None = None
    threads: list[Thread] = []
    head: str | None = None
    frames: list[str] = []

    def end_thread() -> None:
        nonlocal head, frames
        if head is not None:
            m = _THREAD.match(head)
            threads.append(Thread(head, bool(m and m.group(1) == "active"), tuple(frames)))
        head, frames = None, []

    def end_process() -> None:
        nonlocal threads
        end_thread()
        if cur is not None:
            dumps.append(ProcessDump(cur[0], cur[1], cur[2], tuple(threads)))
        threads = []

    for line in text.splitlines():
        m = _PROC_HEAD.match(line)
        if m:
            end_process()
            cur = (int(m.group(1)), m.group(2), m.group(3))
            continue
        if cur is None:
            continue
        if line.startswith("Thread "):
            end_thread()
            head = line.strip()
        elif head is not None and line.startswith("    ") and line.strip():
            frames.append(line.strip())
    end_process()
    return dumps


def innermost(dump: ProcessDump, frames: int = 8, threads: int = 3) -> list[str]:
    """The lines `incidents show` prints for one process: the threads most likely to be where it
    hangs first (active ones, then the main thread), each with its innermost frames."""

    def rank(t: Thread) -> tuple[int, int]:
        return (0 if t.active else 1, 0 if "MainThread" in t.header else 1)

    out: list[str] = []
    ordered = sorted(dump.threads, key=rank)
    for t in ordered[:threads]:
        out.append(t.header)
        shown = list(t.frames[:frames])
        out.extend(f"  {f}" for f in shown)
        # Native frames (libc, libcuda, NCCL) come first in a --native dump; the innermost
        # Python frame says which of SGLang's functions is waiting there, so it is always shown.
        py = next((i for i, f in enumerate(t.frames) if ".py:" in f), None)
        if py is not None and py >= frames:
            if py > frames:
                out.append(f"  ... {py - frames} native frames")
            out.append(f"  {t.frames[py]}")
            shown.append(t.frames[py])
            rest = len(t.frames) - py - 1
        else:
            rest = len(t.frames) - len(shown)
        if rest > 0:
            out.append(f"  ... {rest} outer frames")
    if len(ordered) > threads:
        out.append(f"... {len(ordered) - threads} more threads in stacks.txt")
    return out
