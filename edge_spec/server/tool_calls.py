"""Tool calls in a model's own output format, turned into OpenAI's ``tool_calls``.

Each model family was trained to write calls its own way, which its chat template spells out; the server
reads them back with one parser per format (:data:`FORMATS`), picked by :func:`detect_format` from the
markers the template or the vocabulary holds:

* ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  possibly several, possibly after some text; and, as llama.cpp reads these models too, an answer that is
  nothing but such a call to one of the request's tools, bare or in a ```json block (small Qwen2.5-Coder
  models often answer so);
* ``llama3`` (Llama 3.1 - 3.3): the whole answer is ``{"name": ..., "parameters": {...}}`` (after
  ``<|python_tag|>`` or not; several separated by ``;``);
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the marker is a special token, so
  decoded text usually starts at the ``[``).

Only the request's tools are called: a call naming another function stays text, as the model wrote it.
And where the vocabulary has a format's marker as a token of its own (Qwen's ``<tool_call>``), a call
opens and closes with that token only: the engine's text marks it (:data:`~edge_spec.runtime.text.TOKEN_MARK`
before its text, asked for with ``Engine.generate``'s ``marked_tokens``), and the same characters spelled by
ordinary tokens (a tool result or a web page the model copies, with a ``<tool_call>`` block in it) stay text.

A parser is fed the answer as it streams and returns pieces: text to show, or a complete
:class:`ToolCall`.  Text that may be the start of a call is held back until it is clear, and whitespace
between text and a call is dropped, so parsing a whole answer is feeding it in one piece: streamed and
non-streamed answers agree.  A block that does not parse as a call stays text, as the model wrote it.

Forcing a call (``tool_choice`` "required" or a named function) constrains the answer with
:meth:`ToolFormat.forced_grammar`: the model's own format around a JSON schema of the calls allowed, with
the separators its template writes (so a forced call reads like one the model wrote of its own accord).
A marker the vocabulary has as a token of its own is named by its id there: the grammar engine reads
such tokens as special ones, which no text literal matches.  After a complete call, and after the
separator that follows it, the model may end the answer; where parallel calls are allowed it may go on to
another call, or write a little of anything else (dropped), after which the answer ends, so that a model
meaning to write a word after its call is not driven into call after call.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Protocol, Union

import jinja2
from jinja2 import meta

from edge_spec.runtime.text import TOKEN_MARK

_ALPHANUMERIC = string.ascii_letters + string.digits
_JSON = json.JSONDecoder(strict=False)  # models write raw newlines inside strings (code arguments)
# the separators chat templates render JSON with (Python's json.dumps defaults, as their tojson does)
_TEMPLATE_JSON = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it
    id: str


Piece = Union[str, ToolCall]


class CallParser(Protocol):
    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` completes (text held back earlier included)."""

    def finish(self) -> list[Piece]:
        """The pieces still held at the end of the answer."""


def openai_id() -> str:
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


def mistral_id() -> str:
    """Mistral's templates refuse call ids that are not nine letters or digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def make_call(data, new_id: Callable[[], str], names: Container[str] | None = None) -> ToolCall | None:
    """A call from a decoded ``{"name": ..., "arguments" or "parameters": ...}``, None if it is none
    (``names``: only a call that names one of them and gives its arguments)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    if names is not None and (data["name"] not in names or not ("arguments" in data or "parameters" in data)):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not isinstance(arguments, str):  # a string is JSON text already (some models quote the object)
        return None
    return ToolCall(data["name"], arguments, new_id())


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (without being all of it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class TaggedCalls:
    """Calls wrapped in an opening and a closing tag, anywhere in the answer (hermes); a tag that is a token
    of the model's comes marked (``TOKEN_MARK`` before it).  ``names``: the functions that may be called."""

    def __init__(
        self,
        opening: str,
        closing: str,
        new_id: Callable[[], str] = openai_id,
        names: Container[str] | None = None,
    ) -> None:
        self.opening, self.closing, self.new_id, self.names = opening, closing, new_id, names
        self._pending = ""  # text not yet shown or parsed
        self._in_call = False  # inside an opening tag whose closing tag has not come yet
        self._spaces = ""  # whitespace before the current opening tag: dropped if a call follows
        self._after_call = False  # whitespace that follows a call is dropped too

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        out: list[Piece] = []
        while True:
            if self._in_call:
                end = self._pending.find(self.closing)
                if end < 0:
                    return out
                block, self._pending = self._pending[:end], self._pending[end + len(self.closing) :]
                out += self._resolve(block, closed=True)
                continue
            if self._after_call:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    return out
                self._after_call = False
            start = self._pending.find(self.opening)
            if start < 0:
                held = _partial_suffix(self._pending, self.opening)
                shown = self._pending[: len(self._pending) - held]
                held += len(shown) - len(shown.rstrip())  # trailing whitespace waits for what follows it
                out += _text(self._pending[: len(self._pending) - held])
                self._pending = self._pending[len(self._pending) - held :]
                return out
            before = self._pending[:start]
            out += _text(before.rstrip())
            self._spaces = before[len(before.rstrip()) :]
            self._pending = self._pending[start + len(self.opening) :]
            self._in_call = True

    def finish(self) -> list[Piece]:
        if self._in_call:  # cut short: the call is the JSON before what may begin its closing tag
            bare = self.closing.removeprefix(TOKEN_MARK)  # (its characters too: the length limit cut them)
            cut = max(_partial_suffix(self._pending, self.closing), _partial_suffix(self._pending, bare))
            block = self._pending[: len(self._pending) - cut]
            call = self._parse(block)
            out = self._resolve(self._pending, closed=False) if call is None else self._resolve(block, False, call)
        else:
            out = [] if self._after_call else _text(self._pending)
        self._pending = ""
        return out

    def _resolve(self, block: str, closed: bool, call: ToolCall | None = None) -> list[Piece]:
        self._in_call = False
        call = call or self._parse(block)
        spaces, self._spaces = self._spaces, ""
        if call is None:  # not a call after all: the text as the model wrote it
            return _text(spaces + self.opening + block + (self.closing if closed else ""))
        self._after_call = True
        return [call]

    def _parse(self, block: str) -> ToolCall | None:
        if TOKEN_MARK in block:  # a marker token inside the call: no call the model meant
            return None
        try:
            data = json.loads(block.strip(), strict=False)
        except ValueError:
            return None
        call = make_call(data, self.new_id)
        return call if call is None or self.names is None or call.name in self.names else None


class LeadingCalls:
    """An answer that is calls and nothing else, recognised by how it starts (llama3, mistral): it is held
    until its end once it starts like a call, and streams as text at once otherwise."""

    def __init__(self, starts: tuple[str, ...], parse: Callable[[str], list[ToolCall] | None]) -> None:
        self.starts, self.parse = starts, parse
        self._pending = ""
        self._mode: str | None = None  # "text" or "calls" once the answer's start tells

    @property
    def is_text(self) -> bool:
        """Whether the answer's start has shown it is no call."""
        return self._mode == "text"

    def feed(self, text: str) -> list[Piece]:
        if self._mode == "text":
            return _text(text)
        self._pending += text
        head = self._pending.lstrip()
        if self._mode == "calls" or not head:
            return []
        if any(head.startswith(s) for s in self.starts):
            self._mode = "calls"
            return []
        if any(s.startswith(head) for s in self.starts):
            return []  # may still become one
        self._mode, shown, self._pending = "text", self._pending, ""
        return _text(shown)

    def finish(self) -> list[Piece]:
        text, self._pending = self._pending, ""
        calls = self.parse(text) if self._mode == "calls" and TOKEN_MARK not in text else None
        return list(calls) if calls else _text(text)


class WholeOrTagged:
    """An answer that is calls and nothing else (``whole``), else text with tagged calls in it (``tagged``)."""

    def __init__(self, whole: LeadingCalls, tagged: TaggedCalls) -> None:
        self.whole, self.tagged = whole, tagged
        self._held = ""  # the answer so far, while it may be a whole call
        self._tagged_only = False

    def feed(self, text: str) -> list[Piece]:
        if self._tagged_only:
            return self.tagged.feed(text)
        self._held += text
        self.whole.feed(text)
        if not self.whole.is_text:
            return []
        self._tagged_only = True
        return self.tagged.feed(self._held)

    def finish(self) -> list[Piece]:
        if not self._tagged_only:
            calls = [p for p in self.whole.finish() if isinstance(p, ToolCall)]
            if calls:
                return list(calls)
            self._tagged_only = True
            return self.tagged.feed(self._held) + self.tagged.finish()
        return self.tagged.finish()


class AtMost:
    """A parser passing on its first ``limit`` calls only (``parallel_tool_calls: false``)."""

    def __init__(self, parser: CallParser, limit: int) -> None:
        self.parser, self.limit = parser, limit

    def feed(self, text: str) -> list[Piece]:
        return self._keep(self.parser.feed(text))

    def finish(self) -> list[Piece]:
        return self._keep(self.parser.finish())

    def _keep(self, pieces: list[Piece]) -> list[Piece]:
        kept = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                if self.limit <= 0:
                    continue
                self.limit -= 1
            kept.append(piece)
        return kept


def _text(text: str) -> list[Piece]:
    """Text to show: marker tokens as the characters they are."""
    text = text.replace(TOKEN_MARK, "")
    return [text] if text else []


def _json_values(text: str, separators: str) -> list | None:
    """The JSON values ``text`` holds one after another (separated by whitespace or ``separators``)."""
    values, position = [], 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] in separators):
            position += 1
        if position == len(text):
            return values
        try:
            value, position = _JSON.raw_decode(text, position)
        except ValueError:
            return None
        values.append(value)


def _all_calls(items, new_id: Callable[[], str], names: Container[str] | None = None) -> list[ToolCall] | None:
    calls = [make_call(item, new_id, names) for item in items]
    return calls if calls and all(calls) else None


def parse_untagged(text: str, names: Container[str]) -> list[ToolCall] | None:
    """Hermes calls written without their tags: JSON objects, bare or in one ```json block, to ``names``."""
    text = text.strip()
    if text.startswith("```"):
        if not text.endswith("```") or "\n" not in text:
            return None
        text = text[text.index("\n") : -3]
    return _all_calls(_json_values(text, "") or [], openai_id, names)


def parse_llama3(text: str, names: Container[str] | None = None) -> list[ToolCall] | None:
    values = _json_values(text.strip().removeprefix("<|python_tag|>"), ";")
    return _offered(_all_calls(values or [], openai_id), names)


def parse_mistral(text: str, names: Container[str] | None = None) -> list[ToolCall] | None:
    values = _json_values(text.strip().removeprefix("[TOOL_CALLS]"), "")
    if not values or len(values) != 1:
        return None
    return _offered(_all_calls(values[0] if isinstance(values[0], list) else values, mistral_id), names)


def _offered(calls: list[ToolCall] | None, names: Container[str] | None) -> list[ToolCall] | None:
    """``calls`` if each names one of ``names`` (None: any), else None (the answer is text)."""
    return calls if calls and (names is None or all(c.name in names for c in calls)) else None


# -- forcing a call --------------------------------------------------------------------------------


def call_schema(tools: list[dict], arguments_key: str) -> dict:
    """JSON schema of one call to any of ``tools`` (OpenAI tool objects), name first as templates write it."""
    options = []
    for tool in tools:
        function = tool["function"]
        options.append(
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", arguments_key],
                "properties": {
                    "name": {"const": function["name"]},
                    arguments_key: function.get("parameters") or {"type": "object"},
                },
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": _TEMPLATE_JSON}


TokenId = Callable[[str], "int | None"]  # a marker's token id in the model's vocabulary, if it has one


def _lark_json(schema: dict) -> str:
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _marker(text: str, token_id: TokenId) -> str:
    """A marker in a Lark grammar: its token (``<[id]>``) where the vocabulary has one, else its text."""
    found = token_id(text)
    return f"<[{found}]>" if found is not None else json.dumps(text)


_LEFT_CHARACTERS = 16  # the most a model that leaves a forced answer's format writes before it must end


def _not_starting_with(character: str) -> str:
    """A Lark regex of a little text (up to :data:`_LEFT_CHARACTERS`) that does not start with ``character``
    (bounded in characters, not with llguidance's ``max_tokens``, which the grammar engine cannot roll back
    over, and speculative decoding rolls back rejected drafts)."""
    escaped = {"\n": "\\n", "\\": "\\\\", "/": "\\/", "[": "\\[", "]": "\\]", "^": "\\^", "-": "\\-"}
    return f"/[^{escaped.get(character, character)}](?s:.{{0,{_LEFT_CHARACTERS - 1}}})/"


def _calls(separator: str, opening: str, parallel: bool) -> str:
    """The ``start`` rule of an answer that is one ``call`` or, ``parallel``, calls ``separator`` apart,
    whose calls start with the text ``opening``.

    Where a call is complete the model may end the answer, or write the separator and another call.  It
    may end after the separator too: Qwen2.5-Coder 1.5B ends a forced call with ``</tool_call>``, a newline
    and ``<|endoftext|>``, and a grammar that reads that newline as the way to a next call forces one.  And
    a mask of those alone would hand whatever else the model means to write there (a blank line, a word
    about the call) to the separator, the one other token it allows, driving the model into call after
    call; so a little of anything else is allowed there, after the separator too, and then only the end
    (the server drops that text): the answer ends where the model leaves the format, as it ends of its own
    accord.  Neither that text nor the separator may start like what follows the other, which would leave
    the grammar engine two readings of one token."""
    if not parallel:
        return "start: call\n"
    sep = json.dumps(separator)
    return (
        f"start: call ({sep} call)* ({sep} left? | left_at_once)?\n"
        f"left: {_not_starting_with(opening[0])}\n"
        f"left_at_once: {_not_starting_with(separator[0])}\n"
    )


def hermes_grammar(tools: list[dict], parallel: bool, token_id: TokenId) -> str:
    opening, closing = _marker("<tool_call>", token_id), _marker("</tool_call>", token_id)
    call = f'call: {opening} "\\n" {_lark_json(call_schema(tools, "arguments"))} "\\n" {closing}\n'
    return _calls("\n", "<", parallel) + call


def llama3_grammar(tools: list[dict], parallel: bool, token_id: TokenId) -> str:
    return _calls("; ", "{", parallel) + f"call: {_lark_json(call_schema(tools, 'parameters'))}\n"


def mistral_grammar(tools: list[dict], parallel: bool, token_id: TokenId) -> str:
    marker = "" if token_id("[TOOL_CALLS]") is None else _marker("[TOOL_CALLS]", token_id) + " "  # else the list alone
    more = ' (", " call)*' if parallel else ""
    return f'start: {marker}"[" call{more} "]"\ncall: {_lark_json(call_schema(tools, "arguments"))}\n'


# -- the table -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFormat:
    name: str
    markers: tuple[str, ...]  # in a chat template or a vocabulary, they say the model writes this format
    # given the request's tool names (None: any) and the tags that come marked as tokens
    make_parser: Callable[[frozenset[str] | None, frozenset[str]], CallParser]
    grammar: Callable[[list[dict], bool, TokenId], str]
    closing: str | None = None  # a stop string that ends the answer after one call
    tags: tuple[str, ...] = ()  # the markers its parser reads only as the model's tokens, where they are ones

    def parser(
        self, parallel: bool = True, names: Iterable[str] | None = None, tokens: Iterable[str] = ()
    ) -> CallParser:
        """A parser for one answer; ``names``: the request's tools, the only functions a call may name;
        ``tokens``: the :attr:`tags` that are tokens of the model's, which the text it is fed marks."""
        parser = self.make_parser(None if names is None else frozenset(names), frozenset(tokens))
        return parser if parallel else AtMost(parser, 1)

    def forced_grammar(
        self,
        tools: list[dict],
        *,
        only: str | None = None,
        parallel: bool = True,
        token_id: TokenId = lambda text: None,
    ) -> str:
        """A Lark grammar (llguidance's dialect) for an answer that is one call to ``only`` or, without it,
        one call or more (one when not ``parallel``) to any of ``tools``; ``token_id``: the vocabulary's
        id of a marker that is one token."""
        if only is not None:
            tools, parallel = [t for t in tools if t["function"]["name"] == only], False
        return self.grammar(tools, parallel, token_id)


def hermes_parser(names: frozenset[str] | None, tokens: frozenset[str] = frozenset()) -> CallParser:
    def tag(marker: str) -> str:
        return TOKEN_MARK + marker if marker in tokens else marker

    tagged = TaggedCalls(tag("<tool_call>"), tag("</tool_call>"), names=names)
    if names is None:
        return tagged
    return WholeOrTagged(LeadingCalls(("```json", "{"), lambda text: parse_untagged(text, names)), tagged)


FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat(
            "hermes",
            ("<tool_call>",),
            hermes_parser,
            hermes_grammar,
            closing="</tool_call>",
            tags=("<tool_call>", "</tool_call>"),
        ),
        ToolFormat(
            "mistral",
            ("[TOOL_CALLS]",),
            lambda names, tokens: LeadingCalls(("[TOOL_CALLS]", "[{"), lambda text: parse_mistral(text, names)),
            mistral_grammar,
        ),
        ToolFormat(
            "llama3",
            ("<|python_tag|>",),
            lambda names, tokens: LeadingCalls(("<|python_tag|>", "{"), lambda text: parse_llama3(text, names)),
            llama3_grammar,
        ),
    )
}


def takes_tools(template: str) -> bool:
    """Whether a chat template reads a ``tools`` variable (one that does not would drop them silently)."""
    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:  # a tag this parser lacks: fall back to the name
        return "tools" in template


def detect_format(template: str | None, vocabulary: Container[str]) -> ToolFormat | None:
    """The format a model writes calls in: the first whose markers its chat template holds, else the first
    whose markers its vocabulary holds; None when the template takes no tools or no format is known."""
    if not template or not takes_tools(template):
        return None
    for where in (template, vocabulary):
        for tool_format in FORMATS.values():
            if any(marker in where for marker in tool_format.markers):
                return tool_format
    return None


def split_answer(
    tool_format: ToolFormat,
    text: str,
    parallel: bool = True,
    names: Iterable[str] | None = None,
    tokens: Iterable[str] = (),
) -> tuple[str | None, list[ToolCall]]:
    """A whole answer as OpenAI's message has it: the text outside calls (None when there is none) and the
    calls."""
    parser = tool_format.parser(parallel, names, tokens)
    pieces = parser.feed(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content or None, [p for p in pieces if isinstance(p, ToolCall)]
