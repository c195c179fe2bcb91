"""The canary model of the serving-quality rig: tools/make-canary-model gives the same bytes
twice (one more build beside the cached one). No server here.

The rig's fault hooks are proven on tests/realsglang/test_real_quality.py's own launches of the
canary model, which the daemon runs anyway: the confident reference answer (margins over 1 nat),
`slow-decode` armed by a file (fast, then slowed by at least its sleeps with the same greedy text
and no restart, then fast again) and `perturbed-weights` (16 tokens of another greedy text,
consistently). Starting servers of their own for that here would cost two more launches
(docs/realsglang.md, "The canary model" and "The fault hook").
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from testkit import realsglang as real

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_canary_model_is_deterministic(canary_sgl: real.SGLangEnv, tmp_path: Path) -> None:
    cached = Path(canary_sgl.model)
    again = tmp_path / "canary-model"
    subprocess.run(
        [canary_sgl.python, str(real.CANARY_MAKER), "--rebuild", str(again)],
        check=True,
        capture_output=True,
        timeout=real.BUILD_TIMEOUT,
    )
    sums = (again / "SHA256SUMS").read_text()
    assert "model.safetensors" in sums and "tokenizer.json" in sums
    assert sums == (cached / "SHA256SUMS").read_text()
    subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=again, check=True)
