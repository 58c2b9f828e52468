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
the engine, or the process exiting, writes what is left.  The file is only a cache: one that cannot be
read (cut short, overwritten, written by another program) is set aside under a ``.damaged-TIME`` name,
said in one warning line, and the cache starts empty.

A corpus is read from regular files only (a FIFO would block the read forever, a link to a device would
never end it), each up to :data:`CORPUS_MAX_FILE` bytes, all together up to :func:`corpus_budget` (more
than the cache could hold); what was skipped is said in one line.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import stat
import time
import weakref
import zipfile
from collections import Counter
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
CORPUS_BYTES_PER_TOKEN = 8  # bytes a corpus reads per token of the cache's capacity (text averages 3 to 4)
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", "build", "dist"})
DOCUMENT_KINDS = ("answer", "corpus")
DAMAGED = ".damaged-"  # a damaged file is renamed to its name + this + the time
# why a corpus file of a text suffix was skipped (said in one line)
NOT_REGULAR = "not a regular file"
TOO_LARGE = f"larger than {CORPUS_MAX_FILE // 1024} KiB"
UNREADABLE = "unreadable"
NOT_TEXT = "not UTF-8 text"
PAST_BUDGET = "past the corpus budget"

log = logging.getLogger(__name__)


class DamagedFile(ValueError):
    """The cache file's contents are not a cache this version wrote."""


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

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, path: Path | None = None, vocab_size: int | None = None
    ) -> None:
        """``vocab_size``: the tokenizer's, when known; a file holding other ids is damaged (drafting one
        would feed the target an id its embedding does not have)."""
        if capacity < MIN_CAPACITY:
            raise EdgeSpecError(f"the suffix cache needs room for at least {MIN_CAPACITY} tokens, not {capacity}")
        self.capacity, self.path, self.vocab_size = capacity, path, vocab_size
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
            with open(tmp, "wb") as handle:
                np.savez(handle, tokens=self.index.tokens[: self.index.size], meta=np.array(json.dumps(meta)))

        write_atomic(self.path, write, mode=0o600)
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
        """Read the cache's file; a missing or older one starts an empty cache quietly, a damaged one is
        set aside (:func:`set_aside`) and starts an empty cache too (it is only a cache)."""
        try:
            handle = open(path, "rb")
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("suffix cache %s cannot be read (%s): starting an empty cache", path, exc.strerror or exc)
            return
        with handle:
            try:
                read = read_cache_file(handle, self.vocab_size)
            except Exception as exc:  # zipfile, its decompressors, numpy and the checks raise a dozen kinds
                set_aside(path, handle, exc)
                return
        if read is None:
            return
        tokens, documents, clock = read
        self.index = SuffixIndex(len(tokens))
        self.index.extend(tokens)
        self.documents = documents
        self._starts = np.array([d.start for d in documents], np.int64)
        self._clock = clock


def read_cache_file(handle, vocab_size: int | None = None) -> tuple[np.ndarray, list[Document], int] | None:
    """The tokens, documents and clock a cache file holds (None: a file of another version); raises
    (:class:`DamagedFile`, or whatever zipfile, a decompressor or numpy raise on a damaged file) unless
    the file is exactly what :meth:`SuffixCache.save` writes: two arrays, no member larger than the file
    (no decompression bomb), integer tokens in the vocabulary, documents tiling them, each ended by a
    separator."""
    size = os.fstat(handle.fileno()).st_size
    with zipfile.ZipFile(handle) as archive:
        members = {info.filename: info.file_size for info in archive.infolist()}
    if set(members) != {"tokens.npy", "meta.npy"}:
        raise DamagedFile(f"holds {', '.join(sorted(members)) or 'nothing'}, not tokens and meta")
    if sum(members.values()) > size:
        raise DamagedFile("its members are larger than the file")
    handle.seek(0)
    with np.load(handle, allow_pickle=False) as data:
        tokens, meta_array = data["tokens"], data["meta"]
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise DamagedFile(f"tokens are a {tokens.dtype} array of shape {tokens.shape}")
    if meta_array.shape != () or meta_array.dtype.kind != "U":
        raise DamagedFile("its metadata is not a string")
    meta = json.loads(str(meta_array))
    if not isinstance(meta, dict):
        raise DamagedFile("its metadata is not an object")
    if meta.get("version") != FILE_VERSION:
        return None  # another version's file: not ours to judge; the next save replaces it
    tokens = tokens.astype(np.int64)
    top = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
    if len(tokens) and (tokens.min() < SEPARATOR or tokens.max() >= top):
        raise DamagedFile(f"token ids {tokens.min()} to {tokens.max()} are not in a vocabulary of {top}")
    documents = [_document(entry) for entry in _list(meta.get("documents"), "documents")]
    end = 0
    for document in documents:
        if document.start != end or document.end <= document.start or tokens[document.end - 1] != SEPARATOR:
            raise DamagedFile("its documents do not tile its tokens")
        end = document.end
    if end != len(tokens):
        raise DamagedFile("its documents do not tile its tokens")
    clock = meta.get("clock")
    if not isinstance(clock, int) or clock < 0:
        raise DamagedFile("its clock is not a count")
    return tokens.astype(np.int32), documents, clock


def _list(value, what: str) -> list:
    if not isinstance(value, list):
        raise DamagedFile(f"its {what} are not a list")
    return value


def _document(entry) -> Document:
    entry = _list(entry, "documents")
    if len(entry) != 5:
        raise DamagedFile("a document is not [start, end, used, kind, key]")
    start, end, used, kind, key = entry
    if (
        not all(isinstance(v, int) for v in (start, end, used))
        or kind not in DOCUMENT_KINDS
        or not isinstance(key, str)
    ):
        raise DamagedFile("a document is not [start, end, used, kind, key]")
    return Document(start, end, used, kind, key)


def set_aside(path: Path, handle, why: BaseException) -> Path | None:
    """Rename the damaged cache file ``path`` (read through ``handle``) to ``path.damaged-TIME`` and say so
    in one line; earlier set-aside copies of it go (only the latest is kept).  The file is renamed only
    while ``path`` is still the file read: another process may have replaced it with a sound one."""
    kind = type(why).__name__ if type(why).__module__ == "builtins" else f"{type(why).__module__}.{type(why).__name__}"
    reason = str(why).strip().splitlines()[0][:160] if str(why).strip() else ""
    detail = reason if isinstance(why, DamagedFile) else f"{kind}: {reason}" if reason else kind
    aside = path.with_name(f"{path.name}{DAMAGED}{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        read, now = os.fstat(handle.fileno()), os.stat(path)
        if (read.st_dev, read.st_ino) != (now.st_dev, now.st_ino):
            return None
        for older in path.parent.glob(f"{path.name}{DAMAGED}*"):
            older.unlink(missing_ok=True)
        os.replace(path, aside)
    except OSError as exc:
        log.warning(
            "suffix cache %s is damaged (%s) and could not be set aside (%s): starting an empty cache",
            path,
            detail,
            exc.strerror or exc,
        )
        return None
    log.warning("suffix cache %s is damaged (%s): set aside as %s; starting an empty cache", path, detail, aside.name)
    return aside


def _save_at_exit(ref: weakref.ref) -> None:
    """What a process that never closed its engine (a server stopped, a chat left) learned since its last write."""
    cache = ref()
    if cache is not None:
        with contextlib.suppress(OSError, EdgeSpecError):
            cache.save()


def corpus_files(root: Path, skipped: Counter | None = None) -> dict[str, Path]:
    """The text files under ``root`` a corpus reads, by :func:`file_key`: known source and text suffixes,
    no version-control, environment or build directories, regular files only (links followed: a link to a
    device, a FIFO or a loop is skipped), none larger than :data:`CORPUS_MAX_FILE`.  Files of those
    suffixes skipped are counted in ``skipped`` by reason."""
    skipped = Counter() if skipped is None else skipped
    found = {}
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(files):
            path = Path(directory) / name
            if path.suffix.lower() not in CORPUS_SUFFIXES:
                continue
            try:
                status = os.stat(path)  # follows links; no open: opening a FIFO blocks
            except OSError:
                skipped[UNREADABLE] += 1
                continue
            if not stat.S_ISREG(status.st_mode):
                skipped[NOT_REGULAR] += 1
            elif status.st_size > CORPUS_MAX_FILE:
                skipped[TOO_LARGE] += 1
            else:
                found[file_key(path, status)] = path
    return found


def file_key(path: Path, status: os.stat_result | None = None) -> str:
    status = os.stat(path) if status is None else status
    return f"{path.resolve()}|{status.st_size}|{status.st_mtime_ns}"


class NotRegularFile(OSError):
    """What was opened is no longer a regular file (replaced since it was listed)."""


def read_regular(path: Path, limit: int) -> bytes | None:
    """At most ``limit`` bytes of the regular file ``path`` (None: it holds more).  Opened without
    blocking and checked once open, so that a FIFO or a device put in its place after it was listed is
    neither waited on nor read."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(f"{path}: not a regular file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return None if size > limit else b"".join(chunks)


def corpus_budget(capacity: int) -> int:
    """Bytes a corpus reads in all for a cache of ``capacity`` tokens: what it could hold, with room to
    spare (:data:`CORPUS_BYTES_PER_TOKEN`), and at least one file's worth."""
    return max(CORPUS_MAX_FILE, capacity * CORPUS_BYTES_PER_TOKEN)


def index_corpus(cache: SuffixCache, root: Path, encode: Callable[[str], list[int]]) -> int:
    """Add the text files under ``root`` that the cache does not hold yet (changed or removed ones are
    dropped first), up to :func:`corpus_budget` bytes read; returns how many files were read.  What was
    skipped is said in one warning line."""
    skipped: Counter = Counter()
    files = corpus_files(root, skipped)
    prefix = f"{root.resolve()}{os.sep}"
    held = {key for key in cache.corpus_keys() if key.startswith(prefix)}
    cache.forget(held - set(files))
    budget = corpus_budget(cache.capacity)
    read = 0
    for key, path in files.items():
        if key in held:
            continue
        size = int(key.rsplit("|", 2)[1])
        if size > budget:
            skipped[PAST_BUDGET] += 1
            continue
        try:
            data = read_regular(path, CORPUS_MAX_FILE)
        except NotRegularFile:
            skipped[NOT_REGULAR] += 1
            continue
        except OSError:
            skipped[UNREADABLE] += 1
            continue
        if data is None:
            skipped[TOO_LARGE] += 1
            continue
        budget -= len(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped[NOT_TEXT] += 1
            continue
        if text.strip():
            cache.add_corpus(key, encode(text))
            read += 1
    if skipped:
        count = sum(skipped.values())
        reasons = ", ".join(f"{n} {reason}" for reason, n in skipped.most_common())
        budget_mib = corpus_budget(cache.capacity) / (1 << 20)
        log.warning(
            "corpus %s: skipped %d file%s (%s)",
            root,
            count,
            "" if count == 1 else "s",
            reasons.replace(PAST_BUDGET, f"{PAST_BUDGET} of {budget_mib:.0f} MiB"),
        )
    return read
