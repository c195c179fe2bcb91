"""A name-only stand-in for SGLang's `sgl_kernel` package, for serving on a CPU without it.

SGLang 0.5.23's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports CPU kernels from `sgl_kernel` by
name when its modules load (first: sglang/kernels/ops/kvcache/cache_move.py:10,
`from sgl_kernel import copy_all_layer_kv_cache_cpu`). The CPU build of sgl-kernel is not on
PyPI. This module answers every `from sgl_kernel import <name>` with a function that raises
NotImplementedError naming itself. Nothing here computes anything. It has no submodules on
purpose: SGLang imports those (`sgl_kernel.scalar_type`, `sgl_kernel.kvcacheio`, ...) inside
`try: ... except ImportError:` and falls back to its own Python code when they are missing.

Why that is honest: plain serving of a Llama on a CPU without AMX never calls any of them
(SGLang probes for AMX with `hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`,
sglang/srt/utils/common.py:356, which this package does not register, so the torch-native
paths run). Whatever does call one fails loudly at once: EAGLE3 calls
`copy_all_layer_kv_cache_cpu` while setting up its KV pool and dies, which is why speculative
decoding is tested only against the stand-in. docs/realsglang.md says more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

__version__ = "0.0.0+name-only"


def _missing(qualname: str) -> Callable[..., NoReturn]:
    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"{qualname} is a name-only stub (tools/sglang-env.d/sgl_kernel): the CPU build "
            "of sgl-kernel is not installed, so this kernel cannot run"
        )

    kernel.__name__ = qualname.rsplit(".", 1)[-1]
    kernel.__qualname__ = qualname
    return kernel


def _module_getattr(module_name: str) -> Callable[[str], Any]:
    def __getattr__(name: str) -> Any:  # PEP 562 hook
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # keep the import machinery's probes honest
        return _missing(f"{module_name}.{name}")

    return __getattr__


__getattr__ = _module_getattr(__name__)
