"""Where the repository is: the kit runs from a checkout, never from an installed package."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
