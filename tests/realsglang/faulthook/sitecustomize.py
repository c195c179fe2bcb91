"""Test-only fault injection into the real SGLang 0.5.23 scheduler, switched by KIMI_TEST_FAULT.

This directory is put on PYTHONPATH of a real SGLang server started by
tests/realsglang/server.py, so Python imports this module in every process of the launch (the
main process and its multiprocessing "spawn" children). Without KIMI_TEST_FAULT it does nothing.

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
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

FAULT = "decode-attributeerror"
_TARGET = "sglang.srt.managers.scheduler"
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


def _patch(module: types.ModuleType) -> None:
    scheduler_cls: Any = module.Scheduler
    original = scheduler_cls.run_batch

    def run_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        reqs = getattr(batch, "reqs", None) or ()
        if batch.forward_mode.is_decode():
            warmup = _warmup_ids(self)
            crash = not all(is_warmup(r, warmup) for r in reqs)
        else:
            crash = False
        if crash:
            raise AttributeError(MESSAGE)
        return original(self, batch, *args, **kwargs)

    scheduler_cls.run_batch = run_batch


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("KIMI_TEST_FAULT") == FAULT:
    sys.meta_path.insert(0, _Finder())
elif os.environ.get("KIMI_TEST_FAULT"):
    raise SystemExit(f"KIMI_TEST_FAULT={os.environ['KIMI_TEST_FAULT']!r}: known faults: {FAULT}")
