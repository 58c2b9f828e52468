"""Tool calls in a model's own output format, parsed into OpenAI's ``tool_calls``: one parser per format,
the format picked from the chat template or the vocabulary, streaming equal to parsing the whole answer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from llguidance import LLMatcher
from tokenizers import AddedToken

from edge_spec.runtime.constrain import Constraint, GrammarVocabulary, grammar_for
from edge_spec.server.tool_calls import FORMATS, ToolCall, detect_format, split_answer
from tests import tiny_models
from tests.helpers import WEATHER_TOOL

CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def streamed(format_name: str, text: str, cuts: list[int]) -> list[str | ToolCall]:
    """The pieces a parser gives for ``text`` fed in chunks cut at ``cuts``, adjacent text merged."""
    parser = FORMATS[format_name].parser()
    bounds = [0, *cuts, len(text)]
    pieces = [p for a, b in zip(bounds, bounds[1:]) for p in parser.feed(text[a:b])] + parser.finish()
    merged: list[str | ToolCall] = []
    for piece in pieces:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        elif piece != "":
            merged.append(piece)
    return merged


def shape(pieces: list[str | ToolCall]) -> list:
    """Pieces with calls as (name, arguments object): ids are random."""
    return [p if isinstance(p, str) else (p.name, json.loads(p.arguments)) for p in pieces]


# -- Qwen2.5 / Qwen3 (hermes): <tool_call> JSON </tool_call> ---------------------------------------


def test_hermes_one_call_no_content():
    content, calls = split_answer(FORMATS["hermes"], HERMES_CALL)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_") and len(calls[0].id) > 10


def test_hermes_several_calls_and_text_around_them():
    second = HERMES_CALL.replace("Paris", "Rome")
    content, calls = split_answer(FORMATS["hermes"], f"Let me check both.\n{HERMES_CALL}\n{second}\n")
    assert content == "Let me check both."
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert calls[0].id != calls[1].id


def test_hermes_answer_without_calls_is_kept_exactly():
    text = "  Here is <b>bold</b> and a <tool mention, then\n\n"
    assert split_answer(FORMATS["hermes"], text) == (text, [])


def test_hermes_call_cut_before_its_closing_tag_is_still_a_call():
    """A stop string at the closing tag (one call only) or an end token right after the JSON."""
    content, calls = split_answer(FORMATS["hermes"], HERMES_CALL.removesuffix("\n</tool_call>"))
    assert content is None and calls[0].name == "get_weather"


def test_hermes_block_that_is_not_a_call_stays_text():
    text = "<tool_call>\n{not json}\n</tool_call>"
    assert split_answer(FORMATS["hermes"], text) == (text, [])
    truncated = '<tool_call>\n{"name": "get_weather", "argu'  # the answer ran out of tokens
    assert split_answer(FORMATS["hermes"], truncated) == (truncated, [])


def test_hermes_arguments_given_as_a_json_string_are_passed_on():
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'
    _, calls = split_answer(FORMATS["hermes"], text)
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_hermes_streaming_holds_back_a_marker_and_equals_the_whole_parse():
    text = f"Checking.\n{HERMES_CALL}\n{HERMES_CALL.replace('Paris', 'Lyon')} done <tool"
    whole = shape(streamed("hermes", text, []))
    assert whole == ["Checking.", ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"}), "done <tool"]
    for cut in range(1, len(text)):
        assert shape(streamed("hermes", text, [cut])) == whole, cut
    assert shape(streamed("hermes", text, list(range(1, len(text))))) == whole  # a character at a time


def test_hermes_streamed_text_never_shows_a_marker_piece():
    parser = FORMATS["hermes"].parser()
    shown = ""
    for char in "Sure.\n" + HERMES_CALL:
        shown += "".join(p for p in parser.feed(char) if isinstance(p, str))
        assert "<" not in shown, shown
    assert [p.name for p in parser.finish() if isinstance(p, ToolCall)] == [] and shown == "Sure."


# -- Llama 3.x: the whole answer is {"name": ..., "parameters": ...} -------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
    ],
)
def test_llama3_json_call(text):
    content, calls = split_answer(FORMATS["llama3"], text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_llama3_several_calls_separated_by_semicolons():
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert shape(streamed("llama3", text, [5, 30])) == [("a", {}), ("b", {"x": 1})]


@pytest.mark.parametrize("text", ["Hello there", "{not a call}", '{"answer": 42}', " [1, 2]"])
def test_llama3_text_that_is_no_call_is_content(text):
    assert split_answer(FORMATS["llama3"], text) == (text, [])


def test_llama3_plain_text_streams_at_once():
    parser = FORMATS["llama3"].parser()
    assert parser.feed("Hel") == ["Hel"]
    assert parser.feed("lo {") == ["lo {"]  # a brace later in the answer is text


# -- Mistral: [TOOL_CALLS][{"name": ..., "arguments": ...}] ----------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    ],
)  # marker decoded away
def test_mistral_call(text):
    content, calls = split_answer(FORMATS["mistral"], text)
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()  # Mistral's templates refuse other ids


@pytest.mark.parametrize("text", ["[link](http://x)", "[TOOL_CALLS] broken", "Plain"])
def test_mistral_text_that_is_no_call_is_content(text):
    assert split_answer(FORMATS["mistral"], text) == (text, [])


# -- which format a model writes -------------------------------------------------------------------


@pytest.mark.parametrize(
    "template, vocabulary, expected",
    [
        ("{% if tools %}<tool_call>{% endif %}", [], "hermes"),
        ("{{ tools }}", ["<tool_call>", "</tool_call>"], "hermes"),
        ("{{ tools }}", ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]"], "mistral"),
        ("{{ tools }}", ["<|python_tag|>", "<|eom_id|>"], "llama3"),
        ("{{ tools }} <tool_call>", ["<|python_tag|>"], "hermes"),  # the template's own markup decides first
    ],
)
def test_format_from_template_and_vocabulary(template, vocabulary, expected):
    assert detect_format(template, vocabulary).name == expected


def test_no_format_without_tool_support():
    assert detect_format("{{ messages }}", ["<tool_call>"]) is None  # the template takes no tools
    assert detect_format("{{ tools }}", ["<|im_start|>"]) is None  # tools, but no format this server reads
    assert detect_format(None, ["<tool_call>"]) is None


# -- forcing a call (tool_choice "required" or a named function) -----------------------------------


MARKER_IDS = {"<tool_call>": 5, "</tool_call>": 6, "[TOOL_CALLS]": 7}


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("only, parallel", [(None, True), (None, False), ("get_time", False)])
@pytest.mark.parametrize("ids", [{}, MARKER_IDS])
def test_forced_call_grammars_compile(name, only, parallel, ids):
    grammar = FORMATS[name].forced_grammar([WEATHER_TOOL, CLOCK], only=only, parallel=parallel, token_id=ids.get)
    assert LLMatcher.validate_grammar(grammar) == ""


def test_forced_call_markers_are_their_tokens_where_the_vocabulary_has_them():
    """A grammar engine reads added tokens as special ones, which no text literal matches: a marker the
    vocabulary has is named by its id."""
    assert "<[5]>" in FORMATS["hermes"].forced_grammar([WEATHER_TOOL], token_id=MARKER_IDS.get)
    assert "<[7]>" in FORMATS["mistral"].forced_grammar([WEATHER_TOOL], token_id=MARKER_IDS.get)
    assert '"<tool_call>' in FORMATS["hermes"].forced_grammar([WEATHER_TOOL])


# where a forced answer may end: the mask of each format's grammar over the tiny vocabulary

END_IDS = [0, 2]  # the tiny tokenizer's <|endoftext|> and <|im_end|>
FORCED = {  # format: (one call, the separator its template writes between calls, the next call's opening)
    "hermes": (HERMES_CALL, "\n", "<tool_call>"),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "; ", "{"),
}


@pytest.fixture(scope="module", params=["marker tokens", "spelled markers"])
def tiny_vocabulary(request):
    """The tiny tokenizer with Qwen's call markers as tokens of their own (added, not special, as Qwen has
    them), or without them (the markers spelled by ordinary tokens), and the grammar engine's view of it."""
    tokenizer = tiny_models.make_tokenizer().backend_tokenizer
    if request.param == "marker tokens":
        tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in ("<tool_call>", "</tool_call>")])
    return tokenizer, GrammarVocabulary(tokenizer, tokenizer.get_vocab_size(), END_IDS)


def forced_answer(tiny_vocabulary, name: str, text: str, **options) -> Constraint:
    """The constraint of a forced answer in format ``name`` after the tokens of ``text``."""
    tokenizer, vocabulary = tiny_vocabulary
    grammar = FORMATS[name].forced_grammar([WEATHER_TOOL, CLOCK], token_id=tokenizer.token_to_id, **options)
    constraint = Constraint(grammar_for({"type": "lark", "lark": grammar}), vocabulary)
    for token in tokenizer.encode(text, add_special_tokens=False).ids:
        constraint.advance(token)
    return constraint


def ends(constraint: Constraint) -> bool:
    return bool(constraint.allowed()[END_IDS].all())


def only_ends(constraint: Constraint) -> bool:
    return np.flatnonzero(constraint.allowed()).tolist() == END_IDS


@pytest.mark.parametrize("name", sorted(FORCED))
def test_a_forced_answer_may_end_after_each_complete_call(tiny_vocabulary, name):
    call, separator, _ = FORCED[name]
    assert not ends(forced_answer(tiny_vocabulary, name, call[: len(call) // 2]))
    assert ends(forced_answer(tiny_vocabulary, name, call))
    assert ends(forced_answer(tiny_vocabulary, name, call + separator))  # Qwen2.5-Coder: "</tool_call>\n" and end
    assert ends(forced_answer(tiny_vocabulary, name, call + separator + call))
    assert only_ends(forced_answer(tiny_vocabulary, name, call, parallel=False))
    assert only_ends(forced_answer(tiny_vocabulary, name, call, only="get_weather"))


@pytest.mark.parametrize("name", sorted(FORCED))
@pytest.mark.parametrize("after", ["", "separator"])
def test_after_a_complete_forced_call_anything_but_the_next_call_ends_the_answer(tiny_vocabulary, name, after):
    """A model that would write something else after its call (a word, a blank line) is not driven into
    another call by the mask, which would leave it the separator alone: a little of that something else is
    allowed, and then the end, as the model would have ended the answer on its own."""
    tokenizer, _ = tiny_vocabulary
    call, separator, opening = FORCED[name]
    before = call + (separator if after else "")
    # one character a token: how far the text may go is counted in characters
    word, *rest = [tokenizer.encode(c, add_special_tokens=False).ids[0] for c in "Sure, the call is made."]
    constraint = forced_answer(tiny_vocabulary, name, before)
    assert constraint.allowed()[word] and constraint.forced_tokens() == []  # the model's choice
    constraint.advance(word)
    assert ends(constraint)
    while rest and not only_ends(constraint):  # within a few characters, the end and nothing else
        constraint.advance(rest.pop(0))
    assert len(rest) == len("Sure, the call is made.") - 16
    going_on = forced_answer(tiny_vocabulary, name, call + separator + opening)  # the model's next call
    assert not ends(going_on) and not going_on.allowed()[word]


@pytest.mark.parametrize("name", sorted(FORCED))
@pytest.mark.parametrize("options", [{}, {"parallel": False}])
def test_a_forced_answer_rolls_back_to_any_token(tiny_vocabulary, name, options):
    """Speculative decoding takes back the drafts the target rejects, anywhere in an answer: the constraint
    of a forced answer must roll back to each earlier state (some grammar constructs cannot)."""
    tokenizer, _ = tiny_vocabulary
    call, separator, _ = FORCED[name]
    ids = tokenizer.encode(call if options else call + separator + call + separator, add_special_tokens=False).ids
    if not options:  # and a word that ends the answer
        ids += tokenizer.encode("Sure", add_special_tokens=False).ids[:1]
    constraint = forced_answer(tiny_vocabulary, name, "", **options)
    masks = [constraint.allowed().copy()]
    for token in ids:
        constraint.advance(token)
        masks.append(constraint.allowed().copy())
    for back in range(len(masks) - 1, 0, -1):
        constraint.rollback(1)
        assert (constraint.allowed() == masks[back - 1]).all(), back


# -- hermes: a whole answer that is a call without the tags (small Qwen2.5-Coder models write so) -----

FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
NAMES = frozenset({"get_weather"})


@pytest.mark.parametrize(
    "text", [FENCED, '{"name": "get_weather", "arguments": {"city": "Paris"}}', "\n" + FENCED + "\n"]
)
def test_hermes_an_answer_that_is_only_a_call_to_a_given_tool_is_a_call(text):
    content, calls = split_answer(FORMATS["hermes"], text, names=NAMES)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    for cut in range(1, len(text)):
        parser = FORMATS["hermes"].parser(names=NAMES)
        pieces = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        assert [p.name for p in pieces if isinstance(p, ToolCall)] == ["get_weather"] and not [
            p for p in pieces if isinstance(p, str) and p
        ], cut


@pytest.mark.parametrize(
    "text",
    [
        FENCED.replace("get_weather", "other_tool"),
        '```json\n{"a": 1}\n```',
        '{"name": "get_weather"}',
        FENCED + "\nThat is the call.",
    ],
)
def test_hermes_json_that_is_no_call_to_a_given_tool_stays_text(text):
    assert split_answer(FORMATS["hermes"], text, names=NAMES) == (text, [])
    assert split_answer(FORMATS["hermes"], text) == (text, [])


def test_hermes_untagged_calls_are_read_only_with_the_tool_names():
    assert split_answer(FORMATS["hermes"], FENCED) == (FENCED, [])


def test_hermes_code_answers_still_stream_at_once():
    parser = FORMATS["hermes"].parser(names=NAMES)
    assert parser.feed("```") == []  # may be a ```json call
    assert parser.feed("python\nx = 1") == ["```python\nx = 1"]
    assert FORMATS["hermes"].parser(names=NAMES).feed("Sure: ") == ["Sure:"]


# -- a call to a function the request did not offer ------------------------------------------------

UNOFFERED = {
    "hermes": 'Done.\n<tool_call>\n{"name": "delete_repo", "arguments": {}}\n</tool_call>',
    "llama3": '{"name": "delete_repo", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "delete_repo", "arguments": {}}]',
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_call_to_a_function_not_offered_stays_text(name):
    """Whatever the model writes, only the request's tools become calls; the rest is the model's text."""
    text = UNOFFERED[name]
    assert split_answer(FORMATS[name], text, names=NAMES) == (text, [])
    for cut in range(1, len(text)):  # streamed in two pieces: the same
        parser = FORMATS[name].parser(names=NAMES)
        pieces = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        assert "".join(p for p in pieces if isinstance(p, str)) == text and len(pieces) <= 3, cut
    offered = text.replace("delete_repo", "get_weather")
    assert [c.name for c in split_answer(FORMATS[name], offered, names=NAMES)[1]] == ["get_weather"]


def test_a_call_among_others_to_a_function_not_offered_leaves_the_others_calls():
    second = HERMES_CALL.replace("get_weather", "delete_repo")
    content, calls = split_answer(FORMATS["hermes"], f"{HERMES_CALL}\n{second}", names=NAMES)
    assert [c.name for c in calls] == ["get_weather"] and content == second
