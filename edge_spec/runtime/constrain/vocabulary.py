"""The grammar engine's view of a bundle's tokenizer, and which of the target's rows are real tokens.

A model's logits are often wider than its tokenizer's vocabulary (Qwen2.5: 151,665 tokens, 151,936
rows), and a bundle converted from GGUF names those padding rows ``[PAD151665]`` and so on as ordinary
vocabulary entries.  Neither kind of row is a token the model was trained to emit, and a grammar that
allows any text inside a JSON string would let a ``[PAD...]`` entry through, so :attr:`usable` excludes
them and a constraint never allows them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from llguidance import LLTokenizer
from tokenizers import Tokenizer

from edge_spec.errors import EdgeSpecError


def usable_rows(tokenizer: Tokenizer, width: int) -> np.ndarray:
    """Boolean mask over ``width`` logit rows: True for ids the tokenizer defines, except padding entries
    spelled ``[PAD<id>]``."""
    usable = np.zeros(width, dtype=bool)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    ids = np.fromiter((i for i in vocab.values() if 0 <= i < width), dtype=np.int64)
    usable[ids] = True
    for token, i in vocab.items():
        if 0 <= i < width and token == f"[PAD{i}]":
            usable[i] = False
    return usable


class GrammarVocabulary:
    """llguidance's tokenizer for one bundle (building it reads every token: about a second for a 150k
    vocabulary, so it is built once and shared by every request's constraint)."""

    def __init__(self, tokenizer: Tokenizer, width: int, end_ids: Iterable[int]) -> None:
        """``width``: the target's logit rows; ``end_ids``: the tokens that end an answer (allowed once the
        grammar is complete, never inside it)."""
        self.width = width
        self.end_ids = frozenset(int(i) for i in end_ids)
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        if size > width:
            raise EdgeSpecError(f"the tokenizer has {size} tokens but the model only {width} logit rows")
        self.usable = usable_rows(tokenizer, width)
        self.usable.setflags(write=False)
        self.added_ids = np.array(
            sorted(i for i in tokenizer.get_added_tokens_decoder() if 0 <= i < width), dtype=np.int64
        )  # the tokens the grammar engine reads as special
        if tokenizer.padding is not None or tokenizer.truncation is not None:  # neither belongs in a grammar's view
            tokenizer = Tokenizer.from_str(tokenizer.to_str())
            tokenizer.no_padding()
            tokenizer.no_truncation()
        self._tokenizer = tokenizer
        try:
            self.library = LLTokenizer(tokenizer.to_str(), n_vocab=width, eos_token=sorted(self.end_ids) or None)
        except (ValueError, RuntimeError) as exc:
            raise EdgeSpecError(f"the grammar engine cannot read this tokenizer ({str(exc).strip()[:160]})") from None

    @property
    def source(self) -> str:
        """The tokenizer as JSON, from which another process builds the same vocabulary (``isolated``)."""
        return self._tokenizer.to_str()
