"""``/tokenize`` and ``/detokenize`` in llama-server's shapes, for clients that count or inspect tokens.

``POST /tokenize {"content", "add_special": false, "parse_special": true, "with_pieces": false}`` →
``{"tokens": [ids]}``, or with pieces ``{"tokens": [{"id", "piece"}]}`` where a piece is its text, or its
bytes as a list of integers when they are not whole UTF-8 (a byte-level token cut out of a character).
``POST /detokenize {"tokens": [ids]}`` → ``{"content": text}``, control tokens kept as their text so that a
round trip gives the text back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from edge_spec.runtime.text import TextTokenizer
from edge_spec.server.errors import bad_request


@dataclass(frozen=True)
class TokenizeRequest:
    content: str
    add_special: bool = False  # the beginning-of-sequence token, where the model takes one
    parse_special: bool = True  # control-token strings in the text are those tokens
    with_pieces: bool = False


def parse_tokenize(body: dict) -> TokenizeRequest:
    content = body.get("content")
    if not isinstance(content, str):
        raise bad_request("'content' must be the text to tokenize, as a string", param="content")
    flags = {}
    for key, default in (("add_special", False), ("parse_special", True), ("with_pieces", False)):
        value = body.get(key, default)
        if not isinstance(value, bool):
            raise bad_request(f"'{key}' must be a boolean", param=key)
        flags[key] = value
    return TokenizeRequest(content, **flags)


def parse_detokenize(body: dict, vocab_size: int) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be an array of token ids", param="tokens")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is not in this model's vocabulary (0 to {vocab_size - 1})", param="tokens")
    return tokens


def tokenize(text: TextTokenizer, request: TokenizeRequest, pieces: Callable[[], "TokenPieces"]) -> dict:
    """The answer to ``request``; ``pieces`` gives the (shared, built once) piece table when asked for."""
    if request.parse_special:
        ids = text.tokenizer.encode(request.content, add_special_tokens=False).ids
    else:
        ids = text.encode_literal(request.content)
    if request.add_special:
        ids = text.encode_ids(ids)
    if not request.with_pieces:
        return {"tokens": ids}
    table = pieces()
    return {"tokens": [{"id": i, "piece": table.piece(i)} for i in ids]}


def detokenize(text: TextTokenizer, ids: list[int]) -> dict:
    return {"content": text.tokenizer.decode(ids, skip_special_tokens=False)}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the character a byte-level BPE vocabulary writes → the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


_BYTES = _byte_decoder()


class TokenPieces:
    """What each token stands for, as text or (a piece of a character) bytes.  Reading the tokenizer's
    settings takes a moment for a large vocabulary, so one table serves every request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
        self.byte_level = "ByteLevel" in kinds

    def piece(self, token_id: int) -> str | list[int]:
        if token_id in self.added:
            return self.added[token_id]
        token = self.tokenizer.id_to_token(token_id) or ""
        if self.byte_level and all(c in _BYTES for c in token):
            raw = bytes(_BYTES[c] for c in token)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return list(raw)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
