"""`python -m patchkit.bench URL ...`, the same as `patchkit bench URL ...`; `benchmarks/runtime.py`
runs it this way to keep its load generator out of the front-end's interpreter."""

from patchkit.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
