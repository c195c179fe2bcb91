"""Test-only fault injection into the real SGLang 0.5.23 scheduler, switched by KIMI_TEST_FAULT.

This directory is put on PYTHONPATH of a real SGLang server started by
tests/realsglang/server.py, so Python imports this module in every process of the launch (the
main process and its multiprocessing "spawn" children). Without KIMI_TEST_FAULT it does nothing.

KIMI_TEST_FAULT=decode-attributeerror: in the scheduler, the first decode batch of any request
other than SGLang's own warmup request raises the seed incident's
`AttributeError: 'EAGLEWorkerV2' object has no attribute 'spec_disable_batch_threshold'`.
The hook point is `Scheduler.run_batch` (sglang/srt/managers/scheduler.py:4614 in 0.5.23),
which both event loops call for every batch; an exception there propagates out of
`run_event_loop` to `run_scheduler_process` (scheduler.py:6370-6380), which logs
`Scheduler hit an exception: <traceback>`, sends SIGQUIT to the main process and, with
SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=1, SIGKILLs its process group: SGLang's own crash path,
unchanged. /health (a 1-token request: prefill only) and the warmup (the first request the
scheduler ever sees) pass, as they did in the incident.
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


def _patch(module: types.ModuleType) -> None:
    scheduler_cls: Any = module.Scheduler
    original = scheduler_cls.run_batch
    first_rids: set[str] = set()

    def run_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        rids = {req.rid for req in getattr(batch, "reqs", None) or ()}
        if not first_rids:
            first_rids.update(rids)  # SGLang's warmup request is the first one
        elif batch.forward_mode.is_decode() and rids - first_rids:
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
