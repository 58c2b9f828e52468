"""``/tokenize`` and ``/detokenize`` in llama-server's shapes, for clients that count or inspect tokens.

``POST /tokenize {"content", "add_special": false, "parse_special": true, "with_pieces": false}`` →
``{"tokens": [ids]}``, or with pieces ``{"tokens": [{"id", "piece"}]}`` where a piece is its text, or its
bytes as a list of integers when they are not whole UTF-8 (a byte-level token cut out of a character).
``POST /detokenize {"tokens": [ids]}`` → ``{"content": text}``, control tokens kept as their text so that a
round trip gives the text back.

Both run in a worker thread, and neither may hold up the event loop there: ``tokenizers``' ``encode``
holds the GIL for its whole run (seconds for a few MiB of text), so the text is encoded with
``encode_batch``, which releases it, and the answer is written in pieces (one ``json.dumps`` of a long
list would hold the GIL too).  Each route has its limits, refused with a 400 that names them:
:data:`MAX_CHARACTERS` characters of text to tokenize, :data:`MAX_TOKENS` tokens in an answer or ids to
detokenize, and :data:`MAX_REPLY_BYTES` bytes of answer (pieces, or the text of many long tokens).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from edge_spec.runtime.text import TextTokenizer, literal_tokenizer
from edge_spec.server.errors import bad_request

MAX_CHARACTERS = 262_144  # about 65,000 tokens of English for a real model's tokenizer
MAX_TOKENS = 65_536
MAX_REPLY_BYTES = 4 << 20
_CHUNK = 4096  # ids written per call while rendering an answer


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
    if len(content) > MAX_CHARACTERS:
        raise bad_request(
            f"'content' is {len(content)} characters; /tokenize takes at most {MAX_CHARACTERS} (send the text in parts)",
            param="content",
        )
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
    if len(tokens) > MAX_TOKENS:
        raise bad_request(
            f"'tokens' has {len(tokens)} ids; /detokenize takes at most {MAX_TOKENS} (send them in parts)",
            param="tokens",
        )
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        shown = str(bad) if len(str(bad)) <= 24 else f"{str(bad)[:12]}...({len(str(bad))} digits)"
        raise bad_request(f"token id {shown} is not in this model's vocabulary (0 to {vocab_size - 1})", param="tokens")
    return tokens


class Tokenizers:
    """The model's tokenizer as the routes use it: as it is (control-token strings in the text are those
    tokens) and as a copy that reads them as plain text (``parse_special: false``).  The copy takes a
    moment to build for a large vocabulary, so one serves every request."""

    def __init__(self, text: TextTokenizer) -> None:
        self.text = text
        self.literal = literal_tokenizer(text.tokenizer)

    def encode(self, content: str, parse_special: bool) -> list[int]:
        """The text's ids, without holding the GIL while the tokenizer runs."""
        backend: Tokenizer = self.text.tokenizer if parse_special else self.literal
        return backend.encode_batch([content], add_special_tokens=False)[0].ids


def tokenize(tokenizers: Tokenizers, request: TokenizeRequest, pieces: Callable[[], "TokenPieces"]) -> bytes:
    """The answer to ``request`` as JSON; ``pieces`` gives the (shared, built once) piece table when asked for."""
    ids = tokenizers.encode(request.content, request.parse_special)
    if request.add_special:
        ids = tokenizers.text.encode_ids(ids)
    if len(ids) > MAX_TOKENS:
        raise bad_request(
            f"the text is {len(ids)} tokens; /tokenize answers with at most {MAX_TOKENS} (send the text in parts)",
            param="content",
        )
    if not request.with_pieces:
        return _render("tokens", [",".join(map(str, ids[i : i + _CHUNK])) for i in range(0, len(ids), _CHUNK)])
    table = pieces()
    parts, size = [], 0
    for token in ids:
        part = f'{{"id":{token},"piece":{json.dumps(table.piece(token), ensure_ascii=False)}}}'
        size += len(part.encode()) + 1
        if size > MAX_REPLY_BYTES:
            raise bad_request(
                f"the answer with pieces would be more than {MAX_REPLY_BYTES} bytes; send the text in parts, "
                "or without 'with_pieces'",
                param="with_pieces",
            )
        parts.append(part)
    return _render("tokens", parts)


def detokenize(text: TextTokenizer, ids: list[int]) -> bytes:
    """The answer as JSON (decoded without holding the GIL)."""
    content = text.tokenizer.decode_batch([ids], skip_special_tokens=False)[0]
    body = json.dumps({"content": content}, ensure_ascii=False).encode()
    if len(body) > MAX_REPLY_BYTES:
        raise bad_request(
            f"the text of these tokens is {len(body)} bytes as JSON; /detokenize answers with at most "
            f"{MAX_REPLY_BYTES} (send the ids in parts)",
            param="tokens",
        )
    return body


def _render(key: str, parts: list[str]) -> bytes:
    """``{"key": [part, part, ...]}`` from parts already written as JSON."""
    return (f'{{"{key}":[' + ",".join(parts) + "]}").encode()


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
    """What each token stands for, as text or (a piece of a character) bytes (one table serves every
    request)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        decoder = json.loads(tokenizer.decoder.__getstate__()) if tokenizer.decoder is not None else {}
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
