"""`kimi-serve demo`: the real daemon, unchanged, supervising the bundled SGLang stand-in.

Nothing here is a special path: the demo writes an ordinary config file (the stand-in as
`sglang.module`, a short load, no GPU management, admin on loopback) and runs `Daemon` on it
exactly as `kimi-serve run` does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from supervisor import config as config_mod
from supervisor import log
from supervisor.standin.faults import FAULTS

TEMPLATE = """\
# Written by `kimi-serve demo`: the stand-in plays SGLang; everything else is production code.
sglang:
  python: {python}
  module: supervisor.standin
  model_path: {model}
  host: 127.0.0.1
  port: {sglang_port}
  args:
    tp-size: 2
    speculative-algorithm: EAGLE3
    speculative-draft-model-path: {draft}
    speculative-num-steps: 3
    speculative-eagle-topk: 1
    speculative-num-draft-tokens: 4
    attention-backend: flashinfer
    enable-metrics: true
  env:
{env}
profiles:
  fallback:
    args: {{speculative-algorithm: null, speculative-draft-model-path: null,
           speculative-num-steps: null, speculative-eagle-topk: null,
           speculative-num-draft-tokens: null}}
readiness:
  load_timeout: 60s
  probe: {{endpoint: generate, max_tokens: 8, timeout: 5s}}
liveness: {{interval: 5s, timeout: 3s, failure_threshold: 3}}
restart:
  backoff_initial: 1s
  backoff_max: 10s
  crash_loop: {{max_restarts: 3, window: 5m}}
  fallback_profile: fallback
stop: {{drain_timeout: 5s}}
gpus: {{manage: false}}
admin: {{listen: "127.0.0.1:{admin_port}"}}
state_dir: {state_dir}
logging: {{format: console, level: info}}
# The stand-in answers a prompt's words, repeated: a known answer a wrong model fails
# (`--fault wrong-answer`: the first launch's garbage is caught, never learned as the golden).
quality:
  known_answers:
    - {{prompt: "kimi serves answers", expect: "kimi serves answers kimi"}}
"""


_WHAT = {
    "wrong-answer": "\n            the first launch answers other tokens: its known answer fails,"
    "\n            so it is never ready and nothing is learned (canary_mismatch); the next"
    "\n            launch is verified, then learned (`kimi-serve canary show --config ...`)",
}


def _console_script() -> str:
    """The `kimi-serve` the demo runs as, so the banner's commands work pasted as printed
    (scripts/demo installs it in ./.venv, which need not be on PATH)."""
    beside = Path(sys.executable).with_name("kimi-serve")
    return str(beside) if beside.exists() else "kimi-serve"


def _free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return int(s.getsockname()[1])
            except OSError:
                continue
    raise OSError("no free port on 127.0.0.1")


def write_config(workdir: Path, fault: str | None, load_seconds: float) -> Path:
    env = {
        "STANDIN_LOAD_SECONDS": str(load_seconds),
        "STANDIN_LAUNCH_COUNTER": str(workdir / "launches"),
        # As real SGLang does after a scheduler exception (py-spy, core dump); the daemon does
        # not wait for it: it acts on the traceback in the log.
        "STANDIN_CRASH_SLEEP_SECONDS": "65",
        # As in the shipped config: keeps /proc/PID/environ readable after setproctitle.
        "SPT_NOENV": "1",
    }
    if fault:
        env["STANDIN_FAULT"] = fault
        # Only the first launch is broken, so the demo shows the recovery too.
        env["STANDIN_FAULT_LAUNCH"] = "1"
    models = {}
    for name in ("demo-kimi-k2.5", "demo-eagle3"):
        # Preflight checks that a model directory holds config.json, as a real one does.
        models[name] = workdir / "models" / name
        models[name].mkdir(parents=True)
        (models[name] / "config.json").write_text('{"model_type": "stand-in"}\n')
    path = workdir / "kimi-serve-demo.yaml"
    path.write_text(
        TEMPLATE.format(
            python=sys.executable,
            model=models["demo-kimi-k2.5"],
            draft=models["demo-eagle3"],
            sglang_port=_free_port(30000),
            admin_port=_free_port(29400),
            state_dir=workdir / "state",
            env="\n".join(f'    {k}: "{v}"' for k, v in env.items()),
        )
    )
    return path


def run_demo(
    fault: str | None,
    out: TextIO,
    err: TextIO,
    load_seconds: float = 3.0,
    duration: float | None = None,
) -> int:
    from supervisor.daemon.loop import Daemon

    if fault is not None and fault not in FAULTS:
        print(f"kimi-serve demo: unknown fault {fault!r}; one of: {', '.join(FAULTS)}", file=err)
        return 2
    with tempfile.TemporaryDirectory(prefix="kimi-serve-demo-") as tmp:
        workdir = Path(tmp)
        path = write_config(workdir, fault, load_seconds)
        cfg = config_mod.load(str(path))
        admin = f"http://{cfg.admin.listen}"
        me = _console_script()
        print(
            f"""
kimi-serve demo: the real supervisor, with a stand-in playing SGLang (no GPU needed).
  config:   {path}
  status:   {me} status --config {path}
            (with the admin token the config names: SGLang's traceback included;
            without it, `status --url {admin}` or curl {admin}/status, left out)
  restart:  {me} restart --config {path}  (the token is {cfg.admin.token_file})
  ready?    curl -i {admin}/readyz
  metrics:  curl {admin}/metrics
  SGLang:   http://127.0.0.1:{cfg.sglang.port} (the stand-in; try /generate)
  fault:    {fault or "none (try --fault seed-incident)"}{_WHAT.get(fault or "", "")}
Press Ctrl-C to stop: SGLang is stopped and nothing is left running.
""",
            file=out,
            flush=True,
        )
        log.setup(cfg.logging.format, cfg.logging.level, stream=out)
        os.environ.setdefault("PYTHONUNBUFFERED", "1")

        async def main() -> int:
            if duration is not None:
                asyncio.get_running_loop().call_later(duration, os.kill, os.getpid(), signal.SIGINT)
            return await Daemon(cfg).run()

        code = asyncio.run(main())
        return 0 if code == 0 else code
