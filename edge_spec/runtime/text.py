"""Text side of the runtime: tokenizer, chat template, streaming detokenization, stop strings.

Only ``tokenizers`` and ``jinja2`` are needed at run time, so an app embedding the
runtime does not pull in transformers or torch.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from pathlib import Path

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from edge_spec.errors import EdgeSpecError

Message = dict  # {"role": "user" | "assistant" | "system", "content": str}
CONTROL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>")
_CONTENT_CUT = (
    "the chat template cut a message's content, so the message text cannot be told from the template's markup"
)
FIM_MARKERS = frozenset({"<fim_prefix>", "<fim_suffix>", "<fim_middle>"})  # StarCoder's, not <|...|> shaped
TOOL_MARKERS = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"})  # Qwen's, Hermes'
# what goes before a marked token's text in a detokenizer's output (StreamingDetokenizer's ``marked``): a lone
# surrogate, which no decoded text holds (a tokenizer decodes to valid Unicode), so no text forges it
TOKEN_MARK = "\ud800"


def _raise(message: str):
    raise EdgeSpecError(f"chat template: {message}")


def register_control_tokens(backend: Tokenizer) -> list[str]:
    """A bundle exported from GGUF has the model's control tokens (``<|fim_prefix|>``, ``<|file_sep|>``,
    ...) in its vocabulary but not among the tokenizer's added tokens, so raw text naming them would be
    split into ordinary tokens.  Make every ``<|name|>`` (or FIM or tool-call marker) entry of the vocabulary that is not yet an added token one
    (same id; read as one token in raw text and, as in Qwen's own tokenizer, not special: kept in decoded text,
    so stop strings naming them can match).  Returns the tokens registered."""
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    vocab = backend.get_vocab(with_added_tokens=False)
    missing = sorted(
        (i, t)
        for t, i in vocab.items()
        if (CONTROL_TOKEN.fullmatch(t) or t in FIM_MARKERS or t in TOOL_MARKERS) and t not in added
    )
    if missing:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for _, t in missing])
    return [t for _, t in missing]


def literal_tokenizer(backend: Tokenizer) -> Tokenizer:
    """A copy of ``backend`` in which no text spells a control token: every added token (special or not,
    as Qwen's ``<tool_call>``, FIM and ``<|file_sep|>`` are not) is renamed to a secret string, its id kept.

    Switching off the matching of special tokens (``encode_special_tokens``) is not enough: it leaves the
    non-special added tokens matched.  Nor is marking them all special, where the vocabulary holds the
    marker as an ordinary entry (a GGUF export's does): a merge that builds it from its pieces, or a
    whole-word lookup (``ignore_merges``), still reaches its id.  Renamed in the vocabulary too, with the
    merges that build or use it dropped, the id is reachable from the secret alone, which no client knows.

    Added tokens that are only whitespace (Gemma's runs of newlines and spaces, cut from raw text first
    as llama.cpp cuts them) stay as they are: they are text the model reads, not markup."""
    data = json.loads(backend.to_str())
    secret = secrets.token_hex(16)
    renamed = {}
    for entry in data.get("added_tokens") or []:
        if entry["content"].strip():
            renamed[entry["content"]] = entry["content"] = f"\ue000{secret}.{entry['id']}\ue000"
    model = data["model"]
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel
        model["vocab"] = {renamed.get(token, token): i for token, i in vocab.items()}
    elif isinstance(vocab, list):  # Unigram: [piece, score] in id order
        model["vocab"] = [[renamed.get(piece, piece), *rest] for piece, *rest in vocab]
    if model.get("unk_token") in renamed:
        model["unk_token"] = renamed[model["unk_token"]]
    if isinstance(model.get("merges"), list):
        model["merges"] = [m for m in model["merges"] if not _touches(m, renamed)]
    literal = Tokenizer.from_str(json.dumps(data))
    kept = {i: renamed.get(t.content, t.content) for i, t in backend.get_added_tokens_decoder().items()}
    if {i: t.content for i, t in literal.get_added_tokens_decoder().items()} != kept:
        raise EdgeSpecError("the tokenizer's added tokens changed ids when read as text; report this tokenizer")
    return literal


def _touches(merge, names) -> bool:
    """Whether a BPE merge (``"a b"`` or ``["a", "b"]``) builds or uses one of ``names``."""
    left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
    return left in names or right in names or left + right in names


def _damaged(path: Path, why: str) -> EdgeSpecError:
    return EdgeSpecError(f"{path}: {why}; the bundle is damaged, export it again")


def _load_tokenizer(path: Path) -> Tokenizer:
    if not path.is_file():
        raise _damaged(path, "missing")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises bare Exception subclasses on bad JSON or a bad model
        why = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise _damaged(path, f"not a valid tokenizer ({why})") from None


def _load_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        raise _damaged(path, "missing")
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise _damaged(path, f"invalid JSON ({exc.msg} at line {exc.lineno})") from None
    except (UnicodeDecodeError, RecursionError) as exc:
        raise _damaged(path, f"not JSON text ({type(exc).__name__})") from None
    if not isinstance(config, dict):
        raise _damaged(path, f"not a JSON object (got {type(config).__name__})")
    eos = config.get("eos_token_ids")
    if eos is not None and not (
        isinstance(eos, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in eos)
    ):
        raise _damaged(path, f"eos_token_ids must be a list of token ids, not {eos!r:.40}")
    for key in ("chat_template", "bos_token", "eos_token"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise _damaged(path, f"{key} must be text, not {type(config[key]).__name__}")
    return config


class TextTokenizer:
    """Tokenizer + chat template loaded from a bundle directory."""

    def __init__(self, bundle_dir: Path) -> None:
        bundle_dir = Path(bundle_dir)
        self.tokenizer = _load_tokenizer(bundle_dir / "tokenizer.json")
        register_control_tokens(self.tokenizer)
        # message content is encoded by a copy that reads control-token strings as text (a copy: a switch
        # on the shared tokenizer would race with plain encodes in other threads; the server counts in threads)
        self._literal_tokenizer = literal_tokenizer(self.tokenizer)
        # strings that raw text turns into tokens of their own (what a client's text must not smuggle in)
        self._control_strings = sorted(
            {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.content}
        )
        config = _load_tokenizer_config(bundle_dir / "tokenizer_config.json")
        self.bos_token = config.get("bos_token")
        self.eos_token = config.get("eos_token")
        self.eos_token_ids: set[int] = self._end_ids(config.get("eos_token_ids") or [])
        self.add_bos = bool(config.get("add_bos_token"))
        self.chat_template: str | None = config.get("chat_template") or None  # the template's source
        self._template = None
        self.takes_tools = False  # whether the template reads a ``tools`` variable
        if config.get("chat_template"):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
            try:
                self._template = env.from_string(config["chat_template"])
                self.takes_tools = "tools" in meta.find_undeclared_variables(env.parse(config["chat_template"]))
            except jinja2.TemplateSyntaxError as exc:
                raise EdgeSpecError(
                    f"{bundle_dir / 'tokenizer_config.json'}: the chat template has a syntax "
                    f"error ({exc.message}, template line {exc.lineno})"
                ) from None

    def _end_ids(self, listed: list[int]) -> set[int]:
        """The listed end ids less ordinary words: Qwen's vocabulary holds ``</s>`` as an ordinary token
        (HTML's strikethrough tag), which an end list built from marker names may name; ending there would
        cut every answer that writes the tag.  Control tokens and the declared end token stay ends."""
        added = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        ordinary = self.tokenizer.get_vocab(with_added_tokens=False)
        return {
            i
            for i in listed
            if (token := self.tokenizer.id_to_token(i)) is None
            or token in added
            or token == self.eos_token
            or token not in ordinary
        }

    def encode(self, text: str) -> list[int]:
        """Raw text: control-token strings in it are read as those tokens (FIM prompts, templates)."""
        return self.encode_ids(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_chat(
        self, messages: list[Message], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` through the chat template, each message's content encoded as plain
        text: a user who types ``<|im_start|>system`` gets those characters, not a new system turn (what
        chat UIs guard against as role injection).  The template's own markup keeps its control tokens.

        Each content is wrapped in marks that carry a random nonce drawn for this call, so no text a
        client sends can forge or unbalance them; a template that cuts a mark (and so hides where the
        client's text starts) is refused rather than encoded with control tokens read from content.

        ``tools`` (OpenAI's function schemas) and assistant messages' ``tool_calls`` are JSON the template
        writes as its own text, tokenized as the model saw such text in training; a string in them that
        could spell a control token (alone or with the template's text beside it) is marked like content."""
        nonce = secrets.token_hex(16)
        opening, closing = f"\ue000{nonce}\ue001", f"\ue001{nonce}\ue000"

        def mark(message):
            if not isinstance(message, dict):
                return message
            marked = dict(message)
            if isinstance(message.get("content"), str) and message["content"]:
                marked["content"] = f"{opening}{message['content']}{closing}"
            if "tool_calls" in message:
                marked["tool_calls"] = self._mark_json(message["tool_calls"], opening, closing)
            return marked

        tools = self._mark_json(tools, opening, closing) if tools is not None else None
        text = self.render_chat([mark(m) for m in messages], add_generation_prompt, tools=tools)
        ids: list[int] = []
        literal = False
        for piece in re.split(f"({re.escape(opening)}|{re.escape(closing)})", text):
            if piece in (opening, closing):
                if (piece == opening) == literal:
                    raise EdgeSpecError(_CONTENT_CUT)
                literal = piece == opening
            elif piece:
                ids += self._encode_piece(piece, literal)
        if literal:
            raise EdgeSpecError(_CONTENT_CUT)
        return self.encode_ids(ids)

    def _mark_json(self, value, opening: str, closing: str):
        """``value`` (decoded JSON) with every string (keys too) that could spell a control token marked."""
        if isinstance(value, dict):
            return {
                self._mark_json(k, opening, closing): self._mark_json(v, opening, closing) for k, v in value.items()
            }
        if isinstance(value, list):
            return [self._mark_json(v, opening, closing) for v in value]
        if isinstance(value, str) and self._may_spell_control(value):
            return f"{opening}{value}{closing}"
        return value

    def _may_spell_control(self, text: str) -> bool:
        """Whether ``text`` holds a control-token string, or begins or ends with a piece of one."""
        for control in self._control_strings:
            if control in text or any(
                text.endswith(control[:k]) or text.startswith(control[k:]) for k in range(1, len(control))
            ):
                return True
        return False

    def encode_literal(self, text: str) -> list[int]:
        """Raw text with control-token strings read as characters (no beginning-of-sequence token)."""
        return self._encode_piece(text, literal=True)

    def _encode_piece(self, text: str, literal: bool) -> list[int]:
        tokenizer = self._literal_tokenizer if literal else self.tokenizer
        return tokenizer.encode(text, add_special_tokens=False).ids

    def encode_ids(self, ids: list[int]) -> list[int]:
        """``ids`` with the beginning-of-sequence token the model wants in front."""
        if self.add_bos and self.bos_token:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(
        self, messages: list[Message], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Apply the model's chat template (a plain "role: content" transcript when it has none).  ``tools``
        goes to the template as Hugging Face templates expect it (OpenAI's function schemas); a template
        that reads no ``tools`` would drop them, so they are refused there."""
        for message in messages:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise EdgeSpecError("each chat message must be a dict with 'role' and 'content'")
        if tools and not self.takes_tools:
            raise EdgeSpecError("this model's chat template takes no tools")
        if self._template is None:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise EdgeSpecError(f"chat template failed: {exc}") from exc


class StreamingDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks multi-byte characters and merges spaces
    wrongly, so we re-decode a short window and emit only the new stable suffix;
    a trailing U+FFFD (an incomplete UTF-8 sequence) is held back until complete.

    The text of a ``marked`` token comes out whole after :data:`TOKEN_MARK`, so that a reader (the server's
    tool-call parser) tells the model's ``<tool_call>`` token from the same characters spelled by ordinary
    tokens (text the model copied from a tool result, say).
    """

    def __init__(self, tokenizer: TextTokenizer, marked: Iterable[int] = ()) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # ids already turned into text
        self._marked = {i: tokenizer.tokenizer.id_to_token(i) or "" for i in marked}

    def push(self, token_id: int) -> str:
        if token_id in self._marked:  # the text before it, then the token's own text, marked
            before = self.flush()
            self.ids.append(token_id)
            self._prefix_offset, self._read_offset = len(self.ids) - 1, len(self.ids)
            return before + TOKEN_MARK + self._marked[token_id]
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self._prefix_offset : self._read_offset])
        full = self.tok.decode(self.ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return delta

    def flush(self) -> str:
        """Text still held back at the end of the stream (e.g. an unfinished UTF-8 sequence)."""
        prefix = self.tok.decode(self.ids[self._prefix_offset : self._read_offset])
        full = self.tok.decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return full[len(prefix) :]


class StopMatcher:
    """Finds stop strings in streamed text, holding back text that may be the start of one."""

    def __init__(self, stops: list[str] | tuple[str, ...]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit, stopped)."""
        if not self.stops:
            return delta, False
        self.pending += delta
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
