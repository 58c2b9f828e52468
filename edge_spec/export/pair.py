"""The target/drafter pair, checked before anything is built.

An export builds the target for minutes before it loads the drafter; a drafter the target cannot
verify (another tokenizer, another vocabulary size) must be refused before that, not after.
:func:`check_pair` is that refusal; :func:`export_bundle <edge_spec.export.bundle.export_bundle>` runs
it on :func:`probe_pair`'s cards first, then again on the loaded models.

A card is cheap to make: a Hugging Face directory or hub id gives its ``config.json`` and tokenizer
files (transformers, no weights); a GGUF file gives the token list of its header, read here directly
(transformers' config and tokenizer conversion of a 151k-token GGUF vocabulary takes about fifteen
seconds, its header's token list well under one).  Raw GGUF tokens are compared only with raw GGUF
tokens: a GGUF beside a Hugging Face source is probed through transformers, so both sides are in the
same words.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from edge_spec.errors import EdgeSpecError
from edge_spec.export.sources import LoadedModel, _locate, check_gguf, check_same_tokenizer, gguf_parsed_once


@dataclass
class ModelCard:
    """What the pair check needs of a source: its vocabulary (``tokenizer.get_vocab()``: text -> id)
    and vocabulary size (None: left to the loaded model)."""

    source: str
    tokenizer: object
    vocab_size: int | None
    raw_gguf: bool = False  # the tokens of a GGUF header, not transformers' conversion of them

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
    if cards[0].raw_gguf != cards[1].raw_gguf:
        cards = [probe_model(c.source, raw_gguf=False) if c.raw_gguf else c for c in cards]
    return cards[0], cards[1]


class _TokenList:
    """A GGUF header's token list with the one tokenizer method the check uses."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens

    def get_vocab(self) -> dict[str, int]:
        return {text: i for i, text in enumerate(self.tokens)}


def probe_model(source: str, *, raw_gguf: bool = True) -> ModelCard:
    """``source``'s card without its weights: a GGUF header's tokens (``raw_gguf``, where this reader
    knows the header), else transformers' config and tokenizer."""
    kind, location, gguf_file = _locate(source)
    if kind == "gguf":
        path = Path(location) / gguf_file
        tokens = gguf_tokens(path) if raw_gguf else None
        if tokens is not None:  # the whole file is checked when it loads
            return ModelCard(source, _TokenList(tokens), None, raw_gguf=True)
        check_gguf(path)  # a damaged file: one line, before transformers trips on it
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
