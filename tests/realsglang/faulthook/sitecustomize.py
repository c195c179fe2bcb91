"""Test-only fault injection into the real SGLang 0.5.23 server, switched by KIMI_TEST_FAULT.

This directory is put on PYTHONPATH of a real SGLang server started by
testkit/realsglang.py, so Python imports this module in every process of the launch (the
main process and its multiprocessing "spawn" children). Without KIMI_TEST_FAULT it does nothing.
KIMI_TEST_FAULT holds one fault or several, comma-separated; an unknown name stops the process
with the list of known ones. Each fault patches SGLang's module when it is first imported (a
meta path finder), in whichever process imports it.

KIMI_TEST_FAULT=decode-attributeerror: in the scheduler, the first decode batch holding any
request other than SGLang's own warmup request raises the seed incident's
`AttributeError: 'EAGLEWorkerV2' object has no attribute 'spec_disable_batch_threshold'`.
SGLang's warmup is recognised by its content, not by coming first (kimi-serve's decode probe can
reach the scheduler before it): `_execute_server_warmup` (sglang/srt/entrypoints/http_server.py:
2407-2459 in 0.5.23) posts to /generate `temperature 0, max_new_tokens 8` with the text
"The capital city of France is" (or input_ids [10, 11, 12] with --skip-tokenizer-init).
/health's request (http_server.py:751-768: input_ids [0], max_new_tokens 1) is answered by
its prefill and never decodes.
The hook point is `Scheduler.run_batch` (sglang/srt/managers/scheduler.py:4614 in 0.5.23),
which both event loops call for every batch; an exception there propagates out of
`run_event_loop` to `run_scheduler_process` (scheduler.py:6370-6380), which logs
`Scheduler hit an exception: <traceback>`, sends SIGQUIT to the main process and, with
SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1, SIGKILLs its process group: SGLang's own crash path,
unchanged. /health and the warmup pass, as they did in the incident.

KIMI_TEST_FAULT=perturbed-weights: once the model runner has loaded the weights, every
parameter tensor gets Gaussian noise of KIMI_TEST_PERTURB_SCALE (default 1.0) times its own
standard deviation, from a generator seeded with KIMI_TEST_PERTURB_SEED (default 0), so the same
launch always gets the same noise. The server loads, warms up and decodes as usual, but answers
a different greedy text. The hook point is `ModelRunner.load_model`
(sglang/srt/model_executor/model_runner.py:1270 in 0.5.23), called once per model runner by
`ModelRunner.initialize` (model_runner.py:715) before the KV pool, the attention backend and
any graph capture: the wrapper runs the original and then adds the noise to
`self.model.parameters()` in place (the draft model of a speculative launch is left alone). One
line goes to the log: `kimi-test-fault: perturbed-weights: noise 1 x std on N tensors`. (0.5 x
std changes the random tiny model's answer from its first token, but not the trained canary
model's on seed 0: docs/realsglang.md has the measurements.)

KIMI_TEST_FAULT=slow-decode: in the scheduler, each decode batch holding any request other than
SGLang's warmup sleeps KIMI_TEST_SLOW_DECODE_SECONDS (default 0.2) before it runs, so every
decode step (and the decode tokens/s of every request in it) slows down; prefill batches,
/health and the warmup run at full speed. Two optional triggers let a test slow down a server
that is already serving, without a restart: KIMI_TEST_SLOW_DECODE_AFTER=N runs the first N such
batches at full speed; KIMI_TEST_SLOW_DECODE_FILE=PATH sleeps only while PATH exists (create it
to slow down, remove it to speed up again; checked at every batch). The hook point is
`Scheduler.run_batch` (scheduler.py:4614, as above). When the sleeping starts, one line goes to
the log: `kimi-test-fault: slow-decode: sleeping 0.2 s in each decode batch`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

FAULT = "decode-attributeerror"
PERTURBED = "perturbed-weights"
SLOW = "slow-decode"
KNOWN = (FAULT, PERTURBED, SLOW)
_SCHEDULER = "sglang.srt.managers.scheduler"
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
PREFIX = "kimi-test-fault:"
MESSAGE = "'EAGLEWorkerV2' object has no attribute 'spec_disable_batch_threshold'"
# SGLang's warmup request (http_server.py:2407-2459, 0.5.23).
WARMUP_TEXT = "The capital city of France is"
WARMUP_IDS = [10, 11, 12]
WARMUP_TOKENS = 8


def is_warmup(req: Any, warmup_ids: list[int] | None) -> bool:
    """The scheduler's request carries token ids, not the text (`origin_input_text` is None for
    a text prompt): compare them with the warmup text tokenized by the scheduler's own
    tokenizer (`Scheduler.init_tokenizer`, managers/scheduler.py:891)."""
    params = getattr(req, "sampling_params", None)
    if getattr(params, "max_new_tokens", None) != WARMUP_TOKENS:
        return False
    ids = list(getattr(req, "origin_input_ids", None) or ())
    if getattr(req, "origin_input_text", None) == WARMUP_TEXT or ids == WARMUP_IDS:
        return True
    return warmup_ids is not None and ids == warmup_ids


def _warmup_ids(scheduler: Any) -> list[int] | None:
    tokenizer = getattr(scheduler, "tokenizer", None)
    if tokenizer is None:
        return None
    return list(tokenizer.encode(WARMUP_TEXT))


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        return default if raw in (None, "") else float(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r}: not a number") from None


def _say(msg: str) -> None:
    print(f"{PREFIX} {msg}", file=sys.stderr, flush=True)


class _SlowDecode:
    """When a decode batch sleeps (slow-decode): after `after` batches, while `file` exists."""

    def __init__(self) -> None:
        self.seconds = _float_env("KIMI_TEST_SLOW_DECODE_SECONDS", 0.2)
        self.after = int(_float_env("KIMI_TEST_SLOW_DECODE_AFTER", 0))
        self.file = os.environ.get("KIMI_TEST_SLOW_DECODE_FILE") or None
        self.seen = 0
        self.sleeping = False

    def before_decode(self) -> None:
        self.seen += 1
        on = self.seen > self.after and (self.file is None or os.path.exists(self.file))
        if on and not self.sleeping:
            _say(f"{SLOW}: sleeping {self.seconds:g} s in each decode batch")
        elif self.sleeping and not on:
            _say(f"{SLOW}: decode batches at full speed again")
        self.sleeping = on
        if on:
            time.sleep(self.seconds)


def _patch_scheduler(module: types.ModuleType, faults: frozenset[str]) -> None:
    scheduler_cls: Any = module.Scheduler
    original = scheduler_cls.run_batch
    slow = _SlowDecode() if SLOW in faults else None

    def run_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        reqs = getattr(batch, "reqs", None) or ()
        if batch.forward_mode.is_decode():
            warmup = _warmup_ids(self)
            ours = not all(is_warmup(r, warmup) for r in reqs)
        else:
            ours = False
        if ours and FAULT in faults:
            raise AttributeError(MESSAGE)
        if ours and slow is not None:
            slow.before_decode()
        return original(self, batch, *args, **kwargs)

    scheduler_cls.run_batch = run_batch


def perturb(model: Any, scale: float, seed: int) -> int:
    """Add N(0, (scale * std)^2) noise to every parameter of `model` in place; how many."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    count = 0
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() < 2 or not param.is_floating_point():
                continue
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            std = param.detach().float().std()
            param.add_((noise * (scale * std)).to(param.dtype).to(param.device))
            count += 1
    return count


def _patch_model_runner(module: types.ModuleType, faults: frozenset[str]) -> None:
    del faults
    runner_cls: Any = module.ModelRunner
    original = runner_cls.load_model
    scale = _float_env("KIMI_TEST_PERTURB_SCALE", 1.0)
    seed = int(_float_env("KIMI_TEST_PERTURB_SEED", 0))

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if not getattr(self, "is_draft_worker", False):
            n = perturb(self.model, scale, seed)
            _say(f"{PERTURBED}: noise {scale:g} x std on {n} tensors")
        return out

    runner_cls.load_model = load_model


_PATCHES: dict[str, tuple[Callable[[types.ModuleType, frozenset[str]], None], frozenset[str]]] = {
    _SCHEDULER: (_patch_scheduler, frozenset({FAULT, SLOW})),
    _MODEL_RUNNER: (_patch_model_runner, frozenset({PERTURBED})),
}


class _Loader(importlib.abc.Loader):
    def __init__(
        self, inner: importlib.abc.Loader, patch: Callable[[types.ModuleType], None]
    ) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, faults: frozenset[str]) -> None:
        self._faults = faults

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        entry = _PATCHES.get(fullname)
        if entry is None or not entry[1] & self._faults:
            return None
        patch, faults = entry[0], self._faults
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, lambda m: patch(m, faults))
        return spec


def _faults(raw: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = sorted(names - set(KNOWN))
    if unknown:
        raise SystemExit(f"KIMI_TEST_FAULT={raw!r}: unknown {unknown}; known faults: {KNOWN}")
    return names


if os.environ.get("KIMI_TEST_FAULT"):
    sys.meta_path.insert(0, _Finder(_faults(os.environ["KIMI_TEST_FAULT"])))
