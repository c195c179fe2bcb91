"""The Kubernetes manifests, rendered offline by kubectl's built-in kustomize (no cluster)."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest
import yaml

from testkit.paths import REPO_ROOT

KUBERNETES = REPO_ROOT / "packaging" / "kubernetes"


OVERLAYS = ("one-node", "multi-node")


def kubectl() -> str:
    """kubectl (its built-in kustomize renders the overlays offline; no cluster is contacted)."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl not found: it renders the kustomize overlays (`kubectl kustomize`, no "
            "cluster needed). Install it with `apt-get install kubectl`."
        )
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [kubectl(), "kustomize", str(KUBERNETES / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize {overlay} failed ({proc.returncode}):\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]
