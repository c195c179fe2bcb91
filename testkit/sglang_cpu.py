"""The flags that make real SGLang 0.5.23 serve on a CPU (docs/realsglang.md), once: as the
config's `sglang.args` (the daemon renders them) and as argv for a server started directly."""

from __future__ import annotations

from supervisor.config import ArgValue
from supervisor.sglang.argv import flag_tokens

CPU_ARGS: dict[str, ArgValue] = {
    "device": "cpu",
    "attention-backend": "torch_native",
    "disable-cuda-graph": True,
    "max-total-tokens": 16384,
    "sleep-on-idle": True,
    "enable-metrics": True,
    "tp-size": 1,
}

CPU_FLAGS: tuple[str, ...] = tuple(t for k, v in CPU_ARGS.items() for t in flag_tokens(k, v))
