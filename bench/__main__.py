"""`python -m bench [options]`: the comparison (bench/compare.py); `python -m bench NAME ...`:
the bench NAME of bench.BENCHES, which imports only its own module."""

from __future__ import annotations

import importlib
import sys

from bench import BENCHES


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in BENCHES:
        module = importlib.import_module(f"bench.{BENCHES[args[0]][0]}")
        return int(module.main(args[1:]) or 0)
    from bench.compare import compare

    return compare(args)


if __name__ == "__main__":
    raise SystemExit(main())
