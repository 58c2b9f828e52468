"""Text this engine already produced, kept across requests for the ``suffix`` proposer to draft from.

People who run a local coding model repeat themselves across requests: an agent loop re-sends the
same schemas and emits tool calls of the same shape, an editor asks for the same file again with one
more change, tests for one function look like the tests for the last.  So every answer is kept (with
the last :data:`CONTEXT_TOKENS` tokens of its prompt, so that the way answers begin is matched too) as
a document in one :class:`SuffixIndex`, up to ``capacity`` tokens; past that the documents least
recently drafted from are dropped.  A user may add a corpus (their repository's files), kept as
documents of their own and re-read only when a file changed.

In memory by default.  Kept on disk only where the user names a directory (``--cache-dir``): one
file per bundle (token ids mean nothing to another tokenizer), written with the user's private
permissions, never shared, removed by ``edge-spec cache clear``.  A busy process writes it at most every
:data:`SAVE_INTERVAL` seconds (a full cache is megabytes, too much to write after every answer); closing
the engine, or the process exiting, writes what is left.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.files import write_atomic
from edge_spec.runtime.propose.suffix_index import SEPARATOR, SuffixIndex

MIN_CAPACITY = 1024  # tokens: less holds not even one long answer
DEFAULT_CAPACITY = 1_000_000  # tokens kept across requests (about 40 MB): days of a laptop's answers
CONTEXT_TOKENS = 16  # prompt tokens kept before each answer: the template's turn marker and what precedes it
SAVE_INTERVAL = 30.0  # seconds between two writes of the file after answers (close and exit write the rest)
EVICT_TO = 0.75  # past capacity, drop documents until this share of it is left (a rebuild costs ms)
FILE_VERSION = 1
CORPUS_SUFFIXES = frozenset(
    ".py .pyi .js .jsx .ts .tsx .c .h .cc .cpp .hpp .rs .go .java .kt .swift .rb .php .cs .scala .sh .md "
    ".rst .txt .toml .yaml .yml .json .html .css .sql .lua .r .jl .ex .exs .hs .ml .zig".split()
)
CORPUS_MAX_FILE = 512 * 1024  # bytes: larger files are data, not text to copy from
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", "build", "dist"})


@dataclass
class Document:
    """A span ``[start, end)`` of the index (its separator included)."""

    start: int
    end: int
    used: int  # the cache's clock when it was last added or drafted from
    kind: str = "answer"  # or "corpus"
    key: str = ""  # a corpus file: path, size and modification time


class SuffixCache:
    """See the module docstring.  Not thread-safe: the engine generates one answer at a time."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, path: Path | None = None) -> None:
        if capacity < MIN_CAPACITY:
            raise EdgeSpecError(f"the suffix cache needs room for at least {MIN_CAPACITY} tokens, not {capacity}")
        self.capacity, self.path = capacity, path
        self.index = SuffixIndex()
        self.documents: list[Document] = []
        self._starts = np.empty(0, np.int64)
        self._clock = 0
        self._dirty = False
        self._saved_at: float | None = None  # when this process last wrote the file
        if path is not None:
            self._load(path)
            atexit.register(_save_at_exit, weakref.ref(self))

    @property
    def tokens(self) -> int:
        return self.index.size

    def remember(self, prompt_ids: list[int], answer_ids: list[int]) -> None:
        """Keep one finished answer (too short to copy from: nothing)."""
        if len(answer_ids) < 2:
            return
        self._add(list(prompt_ids[-CONTEXT_TOKENS:]) + list(answer_ids), "answer")

    def add_corpus(self, key: str, tokens: list[int]) -> None:
        self._add(list(tokens), "corpus", key)

    def corpus_keys(self) -> set[str]:
        return {d.key for d in self.documents if d.kind == "corpus"}

    def forget(self, keys: set[str]) -> None:
        """Drop the corpus documents of these keys (files that changed or went away)."""
        kept = [d for d in self.documents if d.key not in keys or d.kind != "corpus"]
        if len(kept) != len(self.documents):
            self._rebuild(kept, [(d.start, d.end) for d in kept])
            self._dirty = True

    def used(self, positions: list[int]) -> None:
        """Drafts came from these positions: their documents are the last to be dropped."""
        if not positions or not self.documents:
            return
        self._clock += 1
        for at in np.searchsorted(self._starts, np.asarray(positions), side="right") - 1:
            self.documents[int(at)].used = self._clock

    def clear(self) -> None:
        """Forget everything, the file included."""
        self.index = SuffixIndex()
        self.documents, self._starts, self._dirty = [], np.empty(0, np.int64), False
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def save(self, throttled: bool = False) -> None:
        """Write the cache to its file (when it has one and something changed), atomically and private;
        ``throttled``: only when this process has not written it in the last :data:`SAVE_INTERVAL` seconds."""
        if self.path is None or not self._dirty:
            return
        if throttled and self._saved_at is not None and time.monotonic() - self._saved_at < SAVE_INTERVAL:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        meta = {
            "version": FILE_VERSION,
            "clock": self._clock,
            "documents": [[d.start, d.end, d.used, d.kind, d.key] for d in self.documents],
        }

        def write(tmp: str) -> None:
            os.chmod(tmp, 0o600)
            with open(tmp, "wb") as handle:
                np.savez(handle, tokens=self.index.tokens[: self.index.size], meta=np.array(json.dumps(meta)))

        write_atomic(self.path, write)
        self._dirty = False
        self._saved_at = time.monotonic()

    def _add(self, tokens: list[int], kind: str, key: str = "") -> None:
        self._clock += 1
        start = self.index.size
        self.index.extend(tokens)
        self.index.end_document()
        self.documents.append(Document(start, self.index.size, self._clock, kind, key))
        self._starts = np.append(self._starts, start)
        self._dirty = True
        if self.index.size > self.capacity:
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used documents (the newest stays) until :data:`EVICT_TO` of the room is used."""
        newest = self.documents[-1]
        total = self.index.size
        dropped: set[int] = set()
        for document in sorted(self.documents[:-1], key=lambda d: d.used):
            if total <= self.capacity * EVICT_TO:
                break
            dropped.add(id(document))
            total -= document.end - document.start
        if newest.end - newest.start > self.capacity:  # one answer larger than the room: keep its end
            dropped = {id(d) for d in self.documents[:-1]}
        kept = [d for d in self.documents if id(d) not in dropped]
        self._rebuild(kept, [(d.start, d.end) for d in kept])

    def _rebuild(self, documents: list[Document], spans: list[tuple[int, int]]) -> None:
        starts = self.index.compact(spans)
        for document, start in zip(documents, starts):
            document.end = start + document.end - document.start
            document.start = start
        self.documents = documents
        self._starts = np.array([d.start for d in documents], np.int64)

    def _load(self, path: Path) -> None:
        """Read the cache's file; a missing, damaged or older one starts an empty cache (it is only a cache)."""
        try:
            with np.load(path, allow_pickle=False) as data:
                tokens = np.asarray(data["tokens"], np.int32)
                meta = json.loads(str(data["meta"]))
            if meta["version"] != FILE_VERSION:
                return
            documents = [Document(int(a), int(b), int(u), str(k), str(key)) for a, b, u, k, key in meta["documents"]]
            if any(d.end > len(tokens) or d.start >= d.end or tokens[d.end - 1] != SEPARATOR for d in documents):
                return
        except (OSError, ValueError, KeyError, TypeError, EOFError):
            return
        self.index = SuffixIndex(len(tokens))
        self.index.extend(tokens)
        self.documents = documents
        self._starts = np.array([d.start for d in documents], np.int64)
        self._clock = int(meta["clock"])


def _save_at_exit(ref: weakref.ref) -> None:
    """What a process that never closed its engine (a server stopped, a chat left) learned since its last write."""
    cache = ref()
    if cache is not None:
        with contextlib.suppress(OSError, EdgeSpecError):
            cache.save()


def corpus_files(root: Path) -> list[Path]:
    """The text files under ``root`` a corpus reads: known source and text suffixes, no version-control,
    environment or build directories, none larger than :data:`CORPUS_MAX_FILE`."""
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(files):
            path = Path(directory) / name
            if path.suffix.lower() in CORPUS_SUFFIXES:
                try:
                    if path.stat().st_size <= CORPUS_MAX_FILE:
                        found.append(path)
                except OSError:
                    continue
    return found


def file_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def index_corpus(cache: SuffixCache, root: Path, encode: Callable[[str], list[int]]) -> int:
    """Add the text files under ``root`` that the cache does not hold yet (changed or removed ones are
    dropped first); returns how many files were read."""
    files = {file_key(path): path for path in corpus_files(root)}
    prefix = f"{root.resolve()}{os.sep}"
    held = {key for key in cache.corpus_keys() if key.startswith(prefix)}
    cache.forget(held - set(files))
    read = 0
    for key, path in files.items():
        if key in held:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            cache.add_corpus(key, encode(text))
            read += 1
    return read
