"""The target/drafter pair, checked before anything is built.

An export builds the target for minutes before it loads the drafter; a drafter the target cannot
verify (another tokenizer, another vocabulary size) must be refused before that, not after.
:func:`check_pair` is that refusal; :func:`export_bundle <edge_spec.export.bundle.build.export_bundle>` runs
it on :func:`probe_pair`'s cards first, then again on the loaded models.

A card is cheap to make, read from the files themselves where they say it plainly: a GGUF file's
header token list (transformers parses every field of the header, then converts the vocabulary: a
minute and a gigabyte for a 151k-token vocabulary, against well under a second for the list), a Hugging
Face directory's ``tokenizer.json`` (the ``tokenizers`` library) and ``config.json``; importing
transformers alone takes seconds.  Elsewhere (a hub id, a directory without ``tokenizer.json``) a card
is transformers' config and tokenizer, without the weights.

Cards read from files of one kind are in the same words.  Cards of a GGUF header and of a Hugging Face
tokenizer are in the same words for the most part, not wholly: transformers rewrites a few tokens as it
converts some GGUF vocabularies (Gemma's tab and runs of spaces).  So two cards are compared as read
where that decides (lists that agree are accepted, the loaded models being checked again; lists that
differ at most of the ids both hold are two vocabularies, refused at once: no rewrite explains that),
and where they differ at a few ids only, both are read again through transformers and compared so.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from edge_spec.errors import EdgeSpecError
from edge_spec.export.sources.resolve import (
    LoadedModel,
    check_gguf,
    check_same_tokenizer,
    gguf_parsed_once,
    locate_source,
)

# whose words a card's vocabulary is in (see the module docstring)
GGUF_HEADER, TOKENIZER_JSON, TRANSFORMERS = "gguf header", "tokenizer.json", "transformers"


@dataclass
class ModelCard:
    """What the pair check needs of a source: its vocabulary (``tokenizer.get_vocab()``: text -> id)
    and vocabulary size (None: left to the loaded model)."""

    source: str
    tokenizer: object
    vocab_size: int | None
    read_from: str = TRANSFORMERS  # GGUF_HEADER, TOKENIZER_JSON or TRANSFORMERS: whose words the vocabulary is in

    @classmethod
    def of(cls, model: LoadedModel) -> ModelCard:
        return cls(model.source, model.tokenizer, model.weights.config.vocab_size)


def check_pair(target: ModelCard, draft: ModelCard) -> None:
    """Refuse a drafter the target cannot verify: another tokenizer or another vocabulary size."""
    check_same_tokenizer(target.tokenizer, draft.tokenizer)
    if None not in (draft.vocab_size, target.vocab_size) and draft.vocab_size != target.vocab_size:
        raise EdgeSpecError(f"drafter vocabulary size {draft.vocab_size} differs from the target's {target.vocab_size}")


def probe_pair(target_source: str, draft_source: str) -> tuple[ModelCard, ModelCard]:
    """Cards of both sources, in comparable words (see the module docstring)."""
    cards = [probe_model(target_source), probe_model(draft_source)]
    if cards[0].read_from != cards[1].read_from and _differing_share(*cards) not in (0.0, 1.0):
        cards = [c if c.read_from == TRANSFORMERS else probe_model(c.source, from_files=False) for c in cards]
    return cards[0], cards[1]


def _differing_share(a: ModelCard, b: ModelCard) -> float:
    """0.0 where both vocabularies list the same text at every id, 1.0 where they differ at more than
    half of the ids both hold (or share none), else the share of all ids at which they differ."""
    a_vocab = {i: text for text, i in a.tokenizer.get_vocab().items()}
    b_vocab = {i: text for text, i in b.tokenizer.get_vocab().items()}
    shared = a_vocab.keys() & b_vocab.keys()
    if not shared or 2 * sum(a_vocab[i] != b_vocab[i] for i in shared) > len(shared):
        return 1.0
    ids = a_vocab.keys() | b_vocab.keys()
    return sum(a_vocab.get(i) != b_vocab.get(i) for i in ids) / len(ids)


class _TokenList:
    """A GGUF header's token list with the one tokenizer method the check uses."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens

    def get_vocab(self) -> dict[str, int]:
        return {text: i for i, text in enumerate(self.tokens)}


class _TokenizerFile:
    """A ``tokenizer.json`` read by the ``tokenizers`` library, with the one method the check uses (what
    transformers' fast tokenizer answers for it, added tokens included)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)


def probe_model(source: str, *, from_files: bool = True) -> ModelCard:
    """``source``'s card without its weights: read from its files (``from_files``: a GGUF header's
    tokens where this reader knows the header, a directory's ``tokenizer.json`` and ``config.json``),
    else transformers' config and tokenizer."""
    kind, location, gguf_file = locate_source(source)
    if kind == "gguf":
        path = Path(location) / gguf_file
        tokens = gguf_tokens(path) if from_files else None
        if tokens is not None:  # the whole file is checked when it loads
            return ModelCard(source, _TokenList(tokens), None, GGUF_HEADER)
        check_gguf(path)  # a damaged file: one line, before transformers trips on it
    elif kind == "hf_dir" and from_files:
        card = _directory_card(source, Path(location))
        if card is not None:
            return card
    from transformers import AutoConfig, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        with gguf_parsed_once():
            hf_config = AutoConfig.from_pretrained(location, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    except EdgeSpecError:
        raise
    except (OSError, ValueError, IndexError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = " (no network? use a local GGUF file or directory)" if kind == "hub" else ""
        raise EdgeSpecError(f"cannot load {source!r}: {first[:200]}{hint}") from exc
    vocab_size = getattr(hf_config, "vocab_size", None)  # as weights_from_state_dict reads it
    return ModelCard(source, tokenizer, None if vocab_size is None else int(vocab_size))


def _directory_card(source: str, directory: Path) -> ModelCard | None:
    """The card of a Hugging Face directory from its ``tokenizer.json`` and ``config.json``; None where
    either cannot be read so (no ``tokenizer.json``: a slow tokenizer transformers converts; a file
    transformers may read and this may not): transformers then reads them, and says what is wrong."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        tokenizer = _TokenizerFile(directory / "tokenizer.json")
    except Exception:  # the tokenizers library raises a bare Exception on a bad file
        return None
    if not isinstance(config, dict):
        return None
    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int):  # nested (a text_config) or absent: transformers knows where
        vocab_size = None
    return ModelCard(source, tokenizer, vocab_size, TOKENIZER_JSON)


# -- a GGUF header's token list ---------------------------------------------------------------------

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY = 8, 9
_TOKENS = b"tokenizer.ggml.tokens"


def gguf_tokens(path: Path) -> list[str] | None:
    """The ``tokenizer.ggml.tokens`` list of the GGUF file ``path``, read from its header without
    parsing the rest; None where the header is not little-endian GGUF v2/v3 or has no token list
    (the caller then asks transformers)."""
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _read_tokens(data)
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return None


def _read_tokens(data) -> list[str] | None:
    if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] not in (2, 3):
        return None
    (kv_count,) = struct.unpack_from("<Q", data, 16)
    at = 24
    for _ in range(kv_count):
        key, at = _string(data, at)
        (kind,) = struct.unpack_from("<I", data, at)
        at += 4
        if key == _TOKENS:
            if kind != _ARRAY or struct.unpack_from("<I", data, at)[0] != _STRING:
                return None
            (count,) = struct.unpack_from("<Q", data, at + 4)
            at += 12
            tokens = []
            for _ in range(count):
                text, at = _string(data, at)
                tokens.append(text.decode("utf-8", errors="replace"))
            return tokens
        at = _skip(data, at, kind)
    return None


def _string(data, at: int) -> tuple[bytes, int]:
    (length,) = struct.unpack_from("<Q", data, at)
    end = at + 8 + length
    if end > len(data):
        raise ValueError("string past the end of the file")
    return data[at + 8 : end], end


def _skip(data, at: int, kind: int) -> int:
    if kind in _SCALAR:
        return at + _SCALAR[kind]
    if kind == _STRING:
        return _string(data, at)[1]
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", data, at)
        at += 12
        if item in _SCALAR:
            return at + _SCALAR[item] * count
        for _ in range(count):
            at = _skip(data, at, item)
        return at
    raise ValueError(f"unknown GGUF value type {kind}")
