"""The tokenizer a GGUF file defines, rebuilt from its own metadata, and the bundle's tokenizer held to it.

transformers converts a GGUF's vocabulary into a ``tokenizers`` tokenizer, and for Gemma it gets the
algorithm wrong: the file carries a SentencePiece *BPE* vocabulary (``tokenizer.ggml.model = llama``:
tokens, scores and token types, no merges), transformers builds a *Unigram* model from it, and Unigram
picks another segmentation ("The capital of France is" becomes ``The ▁c ap it al ▁of ▁Fr an ce ▁is``
although ``▁capital`` and ``▁France`` are tokens).  The model was trained on the BPE segmentation, so
the bundle answered nonsense to well-formed prompts while its graph and weights were right.

This module holds three things:

* :class:`ReferenceTokenizer`: the tokenizer llama.cpp runs on the same metadata (``llm_tokenizer_spm``
  for ``llama`` vocabularies, ``llm_tokenizer_bpe`` for ``gpt2`` ones), in plain Python.  It is
  slow but short enough to read against llama.cpp, which is what makes it the oracle.
* :func:`spm_bpe_tokenizer`: a ``tokenizers`` BPE for SentencePiece-BPE vocabularies whose merges are
  derived from the vocabulary and scores, the way transformers' ``SentencePieceExtractor`` derives
  them for a sentencepiece BPE model; the bundle ships this one.
* :func:`check_matches_reference`: at export, the shipped tokenizer must give the reference's ids on a
  fixed set of sentences, or the export stops.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from edge_spec.errors import EdgeSpecError

log = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # "▁", SentencePiece's whitespace mark

# Sentences the shipped tokenizer must split as the reference does: prose, code with indentation and
# tabs, numbers, punctuation, non-Latin scripts, emoji (with a zero-width joiner), runs of spaces and
# newlines.  Tokenizers that agree on these but not elsewhere differ in an algorithm detail this set
# should then grow to cover.
CHECK_SENTENCES: tuple[str, ...] = (
    "The capital of France is",
    "Hello, world! How are you doing today?",
    'def add(a, b):\n    return a + b\n\n\nif __name__ == "__main__":\n\tprint(add(2, 3))\n',
    "for (int i = 0; i < n; ++i) {\n        total += values[i] * 0.5f;\n}",
    "In 2024, 1,234,567 people paid $3.50 each (about 12.5% of 99999).",
    'Wait... what?! "Quoted" text -- with dashes; semicolons: and (parentheses) [brackets] {braces}.',
    "ประเทศไทยมีกรุงเทพมหานครเป็นเมืองหลวง",
    "北京是中华人民共和国的首都，也是全国的政治中心。",
    "こんにちは、世界！ Привет, мир! مرحبا بالعالم",
    "Café, naïve, Straße, Ångström and œuvre.",
    "I love pizza 🍕 and ninjas 🐱‍👤!!! 👍🏽",
    "a  b   c    d     e      f",
    "  leading spaces and trailing ones   ",
    "line one\nline two\n\n\nline five\r\nend",
    "\n\nstarts with newlines",
)


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer metadata of a GGUF file (``tokenizer.ggml.*``), as llama.cpp reads it."""

    model: str  # "llama" (SentencePiece), "gpt2" (byte-level BPE), ...
    pre: str | None  # the pre-tokenizer's name for gpt2-type vocabularies ("qwen2", "smollm", ...)
    tokens: list[str]
    scores: list[float] | None
    types: list[int] | None
    merges: list[str] | None  # "left right" pairs, best first
    add_space_prefix: bool
    unk_id: int | None = None

    @property
    def sentencepiece_bpe(self) -> bool:
        """A SentencePiece vocabulary with scores and no merges: BPE by score, which transformers turns
        into Unigram for Gemma."""
        return self.model == "llama" and self.scores is not None and not self.merges


def read_gguf_vocab(path: Path) -> GGUFVocab:
    """Read the tokenizer metadata of the GGUF file ``path``.

    Goes through ``gguf.GGUFReader`` looked up at call time, so that inside
    ``sources.gguf_parsed_once`` it reuses the reader the rest of the load has parsed already."""
    import gguf

    reader = gguf.GGUFReader(path)

    def value(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    tokens = value("tokenizer.ggml.tokens")
    if not tokens:
        raise EdgeSpecError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    model = value("tokenizer.ggml.model", "llama")
    scores = value("tokenizer.ggml.scores")
    # llama.cpp's default: SentencePiece vocabularies prefix a space unless the file says otherwise
    add_space_prefix = bool(value("tokenizer.ggml.add_space_prefix", model == "llama"))
    unk = value("tokenizer.ggml.unknown_token_id")
    return GGUFVocab(
        model=model,
        pre=value("tokenizer.ggml.pre"),
        tokens=list(tokens),
        scores=[float(s) for s in scores] if scores is not None else None,
        types=[int(t) for t in value("tokenizer.ggml.token_type")]
        if "tokenizer.ggml.token_type" in reader.fields
        else None,
        merges=value("tokenizer.ggml.merges"),
        add_space_prefix=add_space_prefix,
        unk_id=int(unk) if unk is not None else None,
    )


# -- the reference: llama.cpp's algorithms -------------------------------------------------------------


def _token_ids(tokens: Sequence[str]) -> dict[str, int]:
    """Text to id as llama.cpp's ``token_to_id`` builds it (a repeated text keeps its last id)."""
    return {text: i for i, text in enumerate(tokens)}


def _partition(text: str, specials: Sequence[tuple[str, int]]) -> list[str | int]:
    """llama.cpp's ``tokenizer_st_partition``: cut every occurrence of each special text out of the raw
    text, longest texts first, leaving raw fragments (str) between token ids (int)."""
    fragments: list[str | int] = [text]
    for special, token in specials:
        cut: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int) or special not in fragment:
                cut.append(fragment)
                continue
            pieces = fragment.split(special)
            for k, piece in enumerate(pieces):
                if k:
                    cut.append(token)
                if piece:
                    cut.append(piece)
        fragments = cut
    return fragments


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp, ``llm_tokenizer_bpe``), applied in order: each one
# splits the fragments the previous left, keeping unmatched stretches as fragments of their own.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BPE_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {  # name: (regexes, ignore_merges)
    "gpt2": ((_GPT2,), False),
    "qwen2": ((_QWEN2,), False),
    "stablelm2": ((_QWEN2,), False),
    "llama-bpe": ((_LLAMA3,), True),
    "smollm": ((r"\p{N}", _GPT2), False),
    "starcoder": ((r"\p{N}", _GPT2), False),
    "refact": ((r"\p{N}", _GPT2), False),
}


def _regex_split(text: str, patterns: Sequence[str]) -> list[str]:
    import regex

    words = [text]
    for pattern in patterns:
        compiled = regex.compile(pattern)
        split: list[str] = []
        for word in words:
            at = 0
            for match in compiled.finditer(word):
                if match.start() > at:
                    split.append(word[at : match.start()])
                if match.end() > match.start():
                    split.append(match.group())
                at = match.end()
            if at < len(word):
                split.append(word[at:])
        words = split
    return words


class ReferenceTokenizer:
    """llama.cpp's tokenization of plain text (no special-token parsing, no BOS) from GGUF metadata.

    Only ``encode`` is offered: it is the oracle the shipped tokenizer is compared with, not a
    tokenizer to run prompts through (it is pure Python)."""

    def __init__(self, vocab: GGUFVocab) -> None:
        self.vocab = vocab
        self.ids = _token_ids(vocab.tokens)
        types = vocab.types or [NORMAL] * len(vocab.tokens)
        # user-defined tokens are cut out of raw text even when special tokens are not parsed
        self.specials = sorted(
            ((t, i) for i, t in enumerate(vocab.tokens) if types[i] == USER_DEFINED and t),
            key=lambda item: len(item[0].encode("utf-8")),
            reverse=True,
        )
        if vocab.model == "llama":
            if vocab.scores is None:
                raise ValueError("a SentencePiece vocabulary needs scores")
            self._encode_fragment: Callable[[str, bool], list[int]] = self._spm
        elif vocab.model == "gpt2":
            if vocab.merges is None or vocab.pre not in BPE_PRE_TOKENIZERS:
                raise ValueError(f"no reference for a gpt2 vocabulary with pre-tokenizer {vocab.pre!r}")
            self.patterns, self.ignore_merges = BPE_PRE_TOKENIZERS[vocab.pre]
            self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(vocab.merges)}
            self._encode_fragment = self._bpe
        else:
            raise ValueError(f"no reference for tokenizer model {vocab.model!r}")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as ``llama_tokenize(..., add_special=false, parse_special=false)``."""
        out: list[int] = []
        previous_special = True  # SentencePiece prefixes a space at the start and after special tokens
        for fragment in _partition(text, self.specials):
            if isinstance(fragment, int):
                out.append(fragment)
                previous_special = True
            else:
                out += self._encode_fragment(fragment, previous_special)
                previous_special = False
        return out

    # llama.cpp llm_tokenizer_spm: symbols start as UTF-8 characters; the adjacent pair whose concatenation
    # is a token with the highest score merges first (ties: leftmost); what never became a token falls back
    # to its bytes' <0xNN> tokens.
    def _spm(self, fragment: str, previous_special: bool) -> list[int]:
        text = (" " if self.vocab.add_space_prefix and previous_special else "") + fragment
        symbols: list[str] = list(text.replace(" ", SPACE))
        if not symbols:
            return []
        count = len(symbols)
        nxt = list(range(1, count + 1))
        nxt[-1] = -1
        prv = list(range(-1, count - 1))
        alive = [True] * count
        scores = self.vocab.scores
        heap: list[tuple[float, int, int, int]] = []

        def bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            token = self.ids.get(symbols[left] + symbols[right])
            if token is not None:
                heapq.heappush(heap, (-scores[token], left, right, len(symbols[left]) + len(symbols[right])))

        for i in range(count - 1):
            bigram(i, i + 1)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not (alive[left] and alive[right]) or len(symbols[left]) + len(symbols[right]) != size:
                continue  # one side merged since this pair was queued
            symbols[left] += symbols[right]
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prv[nxt[left]] = left
            bigram(prv[left], left)
            bigram(left, nxt[left])
        out: list[int] = []
        i = 0
        while i >= 0:
            token = self.ids.get(symbols[i])
            out += [token] if token is not None else self._bytes(symbols[i])
            i = nxt[i]
        return out

    def _bytes(self, piece: str) -> list[int]:
        out = []
        for byte in piece.encode("utf-8"):
            token = self.ids.get(f"<0x{byte:02X}>")
            if token is None:
                token = self.vocab.unk_id if self.vocab.unk_id is not None else 0
            out.append(token)
        return out

    # llama.cpp llm_tokenizer_bpe: the pre-tokenizer's regexes cut words; each word, byte-level encoded,
    # starts as characters and merges the adjacent pair with the lowest merge rank first (ties: leftmost).
    def _bpe(self, fragment: str, previous_special: bool) -> list[int]:
        table = _byte_to_unicode()
        out: list[int] = []
        for word in _regex_split(fragment, self.patterns):
            encoded = "".join(table[b] for b in word.encode("utf-8"))
            if self.ignore_merges and encoded in self.ids:
                out.append(self.ids[encoded])
                continue
            symbols = list(encoded)
            while len(symbols) > 1:
                best = min(
                    range(len(symbols) - 1),
                    key=lambda k: (self.ranks.get((symbols[k], symbols[k + 1]), float("inf")), k),
                )
                if (symbols[best], symbols[best + 1]) not in self.ranks:
                    break
                symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
            for symbol in symbols:
                if symbol in self.ids:
                    out.append(self.ids[symbol])
                else:
                    out += [self.ids[ch] for ch in symbol if ch in self.ids]
        return out


def reference_tokenizer(vocab: GGUFVocab) -> tuple[ReferenceTokenizer | None, str]:
    """The reference for ``vocab``, or None and why not: the reference covers SentencePiece (``llama``)
    vocabularies and ``gpt2`` vocabularies whose pre-tokenizer is in :data:`BPE_PRE_TOKENIZERS`.
    Others (WordPiece, RWKV, T5's Unigram, other regexes) are not checked rather than checked wrongly."""
    try:
        return ReferenceTokenizer(vocab), ""
    except ValueError as exc:
        return None, str(exc)


# -- the shipped tokenizer for SentencePiece-BPE vocabularies --------------------------------------------


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to merging by score: every split of a token into two tokens is a merge,
    ranked by the merged token's score (highest first), then by the two parts' scores, as transformers'
    ``SentencePieceExtractor`` ranks them; the token id breaks what ties remain, for a stable file.

    Merging the best-ranked adjacent pair is then SentencePiece's "merge the adjacent pair whose
    concatenation scores highest", except between two different tokens of equal score, where
    SentencePiece takes the leftmost pair and BPE the first-ranked (SentencePiece-BPE vocabularies give
    every ordinary token its own score, so the two do not meet there)."""
    ids = _token_ids(tokens)
    ranked: list[tuple[float, float, float, int, str, str]] = []
    for piece, token in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = ids.get(left), ids.get(right)
            if li is not None and ri is not None:
                ranked.append((-scores[token], -scores[li], -scores[ri], token, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def spm_bpe_tokenizer(vocab: GGUFVocab):
    """A ``tokenizers`` tokenizer that splits as llama.cpp's SentencePiece tokenizer does on ``vocab``:
    BPE with merges from :func:`spm_merges` and byte fallback; spaces become ``▁`` (and every stretch of
    text between special tokens gets a leading ``▁`` when the vocabulary prefixes a space); control and
    unknown tokens are special tokens and user-defined ones (Gemma's ``\\n``, runs of spaces, ``\\t``)
    are cut from the raw text first, as llama.cpp does.  The decoder is Gemma's own."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    if not vocab.sentencepiece_bpe:
        raise ValueError("spm_bpe_tokenizer needs a llama-type vocabulary with scores and no merges")
    types = vocab.types or [NORMAL] * len(vocab.tokens)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None and vocab.unk_id < len(vocab.tokens) else None
    backend = Tokenizer(
        BPE(
            _token_ids(vocab.tokens),
            spm_merges(vocab.tokens, vocab.scores),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [normalizers.Prepend(SPACE)] if vocab.add_space_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    # Gemma's own pre-tokenizer: after the normalizer there is no space left to split at, so the whole
    # stretch between added tokens is one BPE word, as it is one SentencePiece sequence
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []))
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(vocab.tokens, types)
            if kind in (CONTROL, UNKNOWN) and t
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(vocab.tokens, types)
            if kind == USER_DEFINED and t
        ]
    )
    return backend


def replace_backend(tokenizer, backend) -> None:
    """Put ``backend`` under the transformers fast ``tokenizer`` in place of the one it converted.

    In place, not a new ``PreTrainedTokenizerFast``: the GGUF-loaded object keeps its class, its special
    tokens, chat template and ``add_bos_token`` that the bundle's ``tokenizer_config.json`` is written
    from.  The post-processor (BOS insertion) is carried over, and every added token of the converted
    tokenizer must keep its id, or the ids the model was exported with would mean other tokens."""
    from tokenizers import AddedToken

    old = tokenizer.backend_tokenizer
    backend.post_processor = old.post_processor
    kept = []
    for token_id, added in sorted(old.get_added_tokens_decoder().items()):
        if backend.token_to_id(added.content) != token_id:
            raise EdgeSpecError(
                f"the rebuilt tokenizer gives {added.content!r} id "
                f"{backend.token_to_id(added.content)}, the converted one {token_id}"
            )
        kept.append(
            AddedToken(
                added.content,
                single_word=added.single_word,
                lstrip=added.lstrip,
                rstrip=added.rstrip,
                normalized=added.normalized,
                special=added.special,
            )
        )
    backend.add_special_tokens([t for t in kept if t.special])
    backend.add_tokens([t for t in kept if not t.special])
    tokenizer._tokenizer = backend


# -- the export-time check ------------------------------------------------------------------------------


def _ids_from(ids: list[int], at: int) -> str:
    return " ".join(map(str, ids[at : at + 4])) or "(none)"


def check_matches_reference(
    backend, reference: ReferenceTokenizer, label: str, sentences: Sequence[str] = CHECK_SENTENCES
) -> None:
    """Refuse (one line) a shipped tokenizer that splits any of ``sentences`` other than the reference:
    the model would be fed token sequences it never saw in training."""
    for text in sentences:
        got = backend.encode(text, add_special_tokens=False).ids
        want = reference.encode(text)
        if got != want:
            at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise EdgeSpecError(
                f"{label}: the tokenizer the bundle would ship splits {text!r:.70} unlike the GGUF's own "
                f"tokenizer (from token {at}: ids {_ids_from(got, at)} instead of {_ids_from(want, at)}); "
                "refusing to export a model that would be fed token ids it was not trained on"
            )


def fix_gguf_tokenizer(path: Path, tokenizer, label: str | None = None) -> None:
    """Make the transformers ``tokenizer`` loaded from the GGUF file ``path`` split text as the file's own
    tokenizer does, or refuse.

    SentencePiece-BPE vocabularies get the :func:`spm_bpe_tokenizer` backend (transformers builds Unigram
    for Gemma's); every vocabulary the reference covers is then checked on :data:`CHECK_SENTENCES`."""
    vocab = read_gguf_vocab(path)
    label = label or str(path)
    if vocab.sentencepiece_bpe:
        replace_backend(tokenizer, spm_bpe_tokenizer(vocab))
    reference, why_not = reference_tokenizer(vocab)
    if reference is None:
        log.warning("%s: tokenizer not checked against the GGUF's own (%s)", label, why_not)
        return
    check_matches_reference(tokenizer.backend_tokenizer, reference, label)
