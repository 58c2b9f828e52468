"""Where an engine's suffix cache lives: in memory, or in one file per bundle under a directory the user
names (``--cache-dir``), with an optional corpus read into it.

One file per bundle because token ids mean nothing to another tokenizer; named by the bundle's
target weights and tokenizer, so that a re-exported bundle starts afresh instead of drafting from
ids of another vocabulary.  Persisting is the user's choice (off by default: answers can be private).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.propose.suffix_cache import DAMAGED, DEFAULT_CAPACITY, SuffixCache, index_corpus

FILE_PATTERN = "suffix-*.npz"
DAMAGED_PATTERN = f"{FILE_PATTERN}{DAMAGED}*"  # damaged files set aside


def bundle_cache_file(cache_dir: Path, manifest: dict) -> Path:
    """The file of this bundle's cache in ``cache_dir``."""
    identity = json.dumps(
        [[f.get("sha256") for f in manifest["target"].get("files", [])], manifest.get("tokenizer")], sort_keys=True
    )
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() or c in "-._" else "-" for c in manifest["target"].get("name", "bundle"))
    return Path(cache_dir) / f"suffix-{name}-{digest}.npz"


def open_suffix_cache(
    manifest: dict,
    encode: Callable[[str], list[int]],
    cache_dir: Path | None = None,
    capacity: int = DEFAULT_CAPACITY,
    corpus: Path | None = None,
) -> SuffixCache:
    """The engine's cache: read from ``cache_dir`` when given, with ``corpus``'s text files added (only
    those new or changed since the cache last read them)."""
    if corpus is not None and not Path(corpus).is_dir():
        raise EdgeSpecError(f"--corpus {corpus}: not a directory")
    path = None
    if cache_dir is not None:
        cache_dir = Path(cache_dir).expanduser()
        if cache_dir.exists() and not cache_dir.is_dir():
            raise EdgeSpecError(f"--cache-dir {cache_dir}: not a directory")
        path = bundle_cache_file(cache_dir, manifest)
    vocab_size = manifest["target"].get("config", {}).get("vocab_size")
    cache = SuffixCache(capacity, path, vocab_size)  # refuses too small a capacity before it reads the file
    if corpus is not None:
        index_corpus(cache, Path(corpus), encode)
        cache.save()
    return cache


def clear_caches(cache_dir: Path) -> list[Path]:
    """Remove every bundle's suffix cache file in ``cache_dir`` (damaged ones set aside included); returns
    what was removed."""
    removed = []
    directory = Path(cache_dir).expanduser()
    for path in sorted([*directory.glob(FILE_PATTERN), *directory.glob(DAMAGED_PATTERN)]):
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed
