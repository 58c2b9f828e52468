"""What the suffix cache costs: microseconds per draft lookup, bytes per cached token, seconds to fill.

Fills a cache with real text through the bundle's tokenizer -- Python sources and docs from this
machine's installed packages, answer by answer (a file is an answer) -- up to ``--tokens``, then times
the proposer's lookup (``propose.suffix.continuation`` over a 2,000-token request plus the cache, as a
round asks it) at positions of held-out files that were not cached, and at positions of cached files
(where a long match exists).  Memory is the index's arrays (what grows with the cache) and the
process's peak (tracemalloc) while filling.

    .venv/bin/python benchmarks/suffix_cache_cost.py --tokens 1000000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_spec.paths import find_bundle  # noqa: E402
from edge_spec.runtime.propose.suffix import continuation  # noqa: E402
from edge_spec.runtime.propose.suffix_cache import SuffixCache  # noqa: E402
from edge_spec.runtime.propose.suffix_index import MAX_MATCH, SuffixIndex  # noqa: E402
from edge_spec.runtime.text import TextTokenizer  # noqa: E402


def text_files(limit_bytes: int) -> list[Path]:
    """Python and Markdown files of the installed packages, in a fixed order, about ``limit_bytes`` of them."""
    site = Path(sysconfig.get_paths()["purelib"])
    files, total = [], 0
    for path in sorted(site.rglob("*.py")) + sorted(site.rglob("*.md")):
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if 2_000 <= size <= 200_000:
            files.append(path)
            total += size
            if total >= limit_bytes:
                break
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bundle", type=Path, default=None, help="bundle whose tokenizer to use (default: the default)"
    )
    parser.add_argument("--tokens", type=int, default=1_000_000, help="tokens to cache")
    parser.add_argument("--queries", type=int, default=2000)
    args = parser.parse_args()
    tokenizer = TextTokenizer(find_bundle(args.bundle))
    files = text_files(args.tokens * 5)  # about 3-4 bytes a token: enough text, plus held-out files
    encoded = []
    for path in files:
        try:
            encoded.append(tokenizer.encode_literal(path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    cache = SuffixCache(capacity=max(args.tokens * 2, 1024))
    tracemalloc.start()
    start = time.perf_counter()
    cached = 0
    split = len(encoded)
    for i, tokens in enumerate(encoded):
        if cached >= args.tokens:
            split = i
            break
        cache.remember([], tokens)
        cached += len(tokens) + 1
    fill = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    held_out = [t for t in encoded[split:] if len(t) > 2100]
    rng = np.random.default_rng(0)

    def timed(source: list[list[int]]) -> tuple[list[float], float]:
        micros, drafted = [], 0
        for _ in range(args.queries):
            tokens = source[int(rng.integers(len(source)))]
            at = int(rng.integers(2000, len(tokens))) if len(tokens) > 2001 else len(tokens)
            request = SuffixIndex(at + 64)
            request.extend(tokens[max(0, at - 2000) : at])
            context = np.asarray(tokens[max(0, at - MAX_MATCH) : at], np.int32)
            t0 = time.perf_counter()
            drafts = continuation(context, [request, cache.index], 16)[0]
            micros.append((time.perf_counter() - t0) * 1e6)
            drafted += bool(drafts)
        return micros, drafted / args.queries

    cached_files = [t for t in encoded[:split] if len(t) > 2100] or encoded[:split]
    rows = [("held-out text", *timed(held_out or cached_files)), ("cached text", *timed(cached_files))]
    per_million = cache.index.nbytes / cache.tokens * 1e6
    print(
        f"cached {cache.tokens} tokens from {split} files in {fill:.1f} s ({cache.tokens / fill / 1e3:.0f}k tokens/s)"
    )
    print(f"index arrays: {cache.index.nbytes / 2**20:.1f} MiB = {per_million / 2**20:.1f} MiB per 1M tokens")
    print(f"peak traced while filling: {peak / 2**20:.1f} MiB")
    print("| where the round is | lookups | offered drafts | mean µs | median µs | p99 µs |")
    print("|---|---|---|---|---|---|")
    for name, micros, offered in rows:
        p99 = float(np.percentile(micros, 99))
        print(
            f"| {name} | {len(micros)} | {offered:.0%} | {statistics.mean(micros):.0f} | "
            f"{statistics.median(micros):.0f} | {p99:.0f} |"
        )


if __name__ == "__main__":
    main()
