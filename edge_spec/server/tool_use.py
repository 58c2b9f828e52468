"""What one chat request does with its tools, given what the model can do (:mod:`tool_calls`).

* ``tool_choice: "none"``: the template gets no tools and the answer is text, as without tools.
* ``"auto"`` (the default): the template gets the tools; calls in the answer are parsed out.
* ``"required"`` or a named function: the same, and the answer is constrained to be calls (one to the
  named function) in the model's own format, so a call is certain rather than hoped for.
* ``parallel_tool_calls: false``: at most one call is returned, and the answer stops after it where the
  format has a closing marker.

A forced answer is calls and nothing else, so whatever text its parser hands back is what the length
limit left of a call (``max_tokens`` cut it), or the little text past a complete call by which the model
left the format and so ended the answer (see :meth:`ToolFormat.forced_grammar`): that is dropped rather
than shown as ``content``.  A cut answer returns the complete calls before the cut, with
finish reason "length" as OpenAI reports a cut answer; one the model ended, "tool_calls".

A request whose tools the model cannot take (its template reads no ``tools``, or writes calls in a format
this server does not read) is refused (400 naming ``tools``), never answered as if no tools were sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llguidance import LLMatcher

from edge_spec.runtime.text import TOKEN_MARK
from edge_spec.server.errors import bad_request
from edge_spec.server.schemas import ToolRequest
from edge_spec.server.tool_calls import CallParser, Piece, TokenId, ToolCall, ToolFormat


@dataclass(frozen=True)
class ToolUse:
    tools: list[dict]  # for the chat template
    format: ToolFormat
    parallel: bool
    grammar: str | None = None  # a Lark grammar the answer must follow (a call is forced)
    stop: tuple[str, ...] = ()  # stop strings to add
    marked: dict[str, int] = field(default_factory=dict)  # the format's tags that are tokens: their ids

    def parser(self) -> CallParser:
        names = [tool["function"]["name"] for tool in self.tools]
        parser = self.format.parser(self.parallel, names=names, tokens=self.marked)
        return parser if self.grammar is None else CallsOnly(parser)

    @property
    def marked_tokens(self) -> frozenset[int]:
        """The tokens whose text the engine marks for the parser (``Engine.generate``'s ``marked_tokens``)."""
        return frozenset(self.marked.values())

    @property
    def response_format(self) -> dict | None:
        """The constraint as ``Engine.generate`` takes it."""
        return None if self.grammar is None else {"type": "lark", "lark": self.grammar}


class CallsOnly:
    """A forced answer's parser: only the calls of ``parser``'s pieces (the grammar admits no text, so
    text there is a call cut short)."""

    def __init__(self, parser: CallParser) -> None:
        self._parser = parser

    def feed(self, text: str) -> list[Piece]:
        return [piece for piece in self._parser.feed(text) if isinstance(piece, ToolCall)]

    def finish(self) -> list[Piece]:
        return [piece for piece in self._parser.finish() if isinstance(piece, ToolCall)]


def plan_tools(
    request: ToolRequest | None,
    tool_format: ToolFormat | None,
    takes_tools: bool,
    token_id: TokenId = lambda text: None,
) -> ToolUse | None:
    """How to answer ``request``'s tools on a model whose template ``takes_tools`` and writes calls in
    ``tool_format`` (``token_id``: the vocabulary's id of a call marker, if it is one token); None: answer
    without tools."""
    if request is None or request.choice == "none":
        return None
    if not takes_tools:
        raise bad_request(
            'this model\'s chat template takes no tools, so it cannot call them (send tool_choice "none", or no tools)',
            param="tools",
        )
    if tool_format is None:
        raise bad_request(
            "this server does not know the format this model writes tool calls in (it reads "
            "Qwen's <tool_call>, Llama 3's JSON and Mistral's [TOOL_CALLS])",
            param="tools",
        )
    marked = {tag: token_id(tag) for tag in tool_format.tags if token_id(tag) is not None}
    closing = tool_format.closing
    if closing in marked:  # only the model's closing token ends a call, not its characters in an argument
        closing = TOKEN_MARK + closing
    stop = (closing,) if not request.parallel and closing else ()
    grammar = None
    if request.choice == "required":
        grammar = tool_format.forced_grammar(
            request.tools, only=request.function, parallel=request.parallel, token_id=token_id
        )
        problem = LLMatcher.validate_grammar(grammar)
        if problem:
            raise bad_request(
                f"cannot force a call to these tools: {problem.strip().splitlines()[-1][:300]}", param="tools"
            )
    return ToolUse(list(request.tools), tool_format, request.parallel, grammar, stop, marked)
