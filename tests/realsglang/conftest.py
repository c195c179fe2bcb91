"""The real `kimi-serve run` against the real SGLang 0.5.23 server on this CPU.

The server side (environment, tiny model, CPU flags, fault hook) is testkit/realsglang.py
and tools/sglang-env; the daemon side is testkit/realsglang.py too (`daemon_config`,
`real_daemon`): the daemon's JSON log lines on a queue, `wait_state()` blocking on them. Each
launch of the real server costs 20-60 s on two cores, so one daemon serves a whole module
(`module_daemon`), and the tests of a module run in file order against it.
"""

from __future__ import annotations

import pytest

from testkit import realsglang as real


@pytest.fixture(scope="session")
def sgl() -> real.SGLangEnv:
    return real.build_env()


@pytest.fixture(scope="session")
def canary_sgl(sgl: real.SGLangEnv) -> real.SGLangEnv:
    """The real environment serving the confident canary model (tools/make-canary-model), built
    on first use: `daemon_config(tmp, canary_sgl, quality={"canary": {"prompt":
    real.CANARY_PROMPT}})`."""
    return real.canary_env(sgl)
