"""Speculative vs autoregressive on the same bundle, measured in one run (wraps `edge-spec bench`).

    python benchmarks/studies/spec_vs_ar.py [BUNDLE] [--max-tokens 64] [--temperature 0 --temperature 0.7] ...

Prints per-category τ, MBSU, tokens/s and the wall-clock speed-up of every
drafter head against `ar`, writes bench-results/bench.json and bench.png.
Any extra flags are passed through to `edge-spec bench`.
"""

from __future__ import annotations

import sys

from edge_spec.cli import main
from edge_spec.paths import DEFAULT_BUNDLE

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        args = [str(DEFAULT_BUNDLE), *args]
    if "--threads" not in args:
        args += ["--threads", "2"]
    sys.argv = ["edge-spec", "bench", *args]
    main()
