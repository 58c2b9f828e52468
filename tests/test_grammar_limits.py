"""Schemas and grammars that cannot constrain an answer: refused in one line, in bounded time.

A grammar that llguidance cannot compile, that passes one of its limits, that accepts no text (a ``$ref``
cycle, bounds no value meets) or only the empty answer is refused by the Python API (one
``EdgeSpecError`` line) and by the server (400 naming the field), for ``response_format`` and for the
tool parameters a forced call follows.  What no limit of llguidance bounds, the time a compile takes,
the server bounds by compiling first in a child process that it ends at a time limit; ``/health``
answers meanwhile.  A pattern bomb (nested counted repetitions) is refused before anything compiles it,
so the child is neither busy with it nor ended for it.
"""

from __future__ import annotations

import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from llguidance import LLMatcher  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from edge_spec.errors import EdgeSpecError  # noqa: E402
from edge_spec.runtime.constrain import (  # noqa: E402
    MAX_EXPANSION,
    CheckerBusy,
    Constraint,
    GrammarChecker,
    GrammarRefused,
    compile_grammar,
    grammar_for,
    pattern_problem,
    schema_pattern_problem,
    self_reference,
)
from edge_spec.runtime.constrain.patterns import expansion  # noqa: E402
from edge_spec.runtime.engine import Engine  # noqa: E402
from edge_spec.runtime.loops.config import TreeConfig  # noqa: E402
from edge_spec.server.serve import build_app  # noqa: E402
from tests import helpers  # noqa: E402
from tests.test_server_tools import ASK, tools_bundle  # noqa: E402, F401  (the bundle fixture)

BASE = "http://127.0.0.1:8000"
CHAT = [{"role": "user", "content": "hello world"}]
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
NESTED_CYCLE = {
    "type": "object",
    "properties": {"x": {"$ref": "#/$defs/a"}},
    "required": ["x"],
    "$defs": CYCLE["$defs"],
}
NO_LENGTH = {"type": "string", "minLength": 5, "maxLength": 2}
BOMB = {"type": "string", "pattern": "^(a{1000}){1000}$"}  # llguidance's lexer: seconds, then a lexer error
BOMB_GRAMMAR = LLMatcher.grammar_from_json_schema(BOMB)  # past the static check: for the child's time limit
SLOW = {
    "type": "object",
    "properties": {f"p{i}": {"type": "integer"} for i in range(6000)},
}  # seconds, then a parser error
GOOD = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
QUICK = 1.0  # the compile time limit the tests set (seconds)
SHORT = 0.2  # a limit well under what BOMB (0.5-1 s) and SLOW (about 3 s) take to fail on a fast machine


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


IMPOSSIBLE = [
    (schema_format(CYCLE), "refers only to itself"),
    (schema_format(NESTED_CYCLE), "refers only to itself"),
    (schema_format(NO_LENGTH), "minLength (5) is greater than maxLength (2)"),
    (schema_format({"not": {}}), "cannot compile"),
    ({"type": "regex", "regex": "[^\\x00-\\U0010FFFF]"}, "accepts no text"),
    ({"type": "regex", "regex": "a{0}"}, "accepts only an empty answer"),
    ({"type": "lark", "lark": "start: undefined_rule"}, "cannot compile"),
]


@pytest.fixture(scope="module")
def engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, mode="spec", threads=1)


@pytest.fixture(scope="module")
def checker(engine):
    checker = GrammarChecker(engine.grammar_vocabulary())
    yield checker
    checker.close()


# -- the Python API --------------------------------------------------------------------------------


@pytest.mark.parametrize("response_format, fragment", IMPOSSIBLE)
def test_the_python_api_refuses_impossible_grammars_in_one_line(engine, response_format, fragment):
    with pytest.raises(EdgeSpecError) as info:
        engine.complete("def f", max_new_tokens=8, response_format=response_format)
    message = str(info.value)
    assert message.startswith("response_format") and fragment in message and "\n" not in message, message


def test_recursion_is_no_cycle():
    tree = {
        "$defs": {
            "node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
        },
        "$ref": "#/$defs/node",
    }
    assert self_reference(tree) is None
    assert self_reference({"anyOf": [{"$ref": "#"}, {"type": "null"}]}) is None  # null ends it
    assert self_reference({"properties": {"a": {"type": "string"}}, "$defs": CYCLE["$defs"]}) is None  # unused
    assert "# -> #/allOf/0 -> #" in self_reference({"allOf": [{"$ref": "#"}]})


def test_a_grammar_that_compiles_keeps_its_initial_state(engine):
    vocabulary = engine.grammar_vocabulary()
    matcher = compile_grammar(grammar_for(schema_format(GOOD)), vocabulary)
    assert not matcher.is_error() and matcher.compute_ff_bytes() == b"{"  # nothing consumed by the checks
    answer = engine.complete("def f", max_new_tokens=40, temperature=0.0, response_format=schema_format(GOOD))
    assert answer.text.startswith("{")


@pytest.mark.parametrize(
    "pattern, size",
    [
        ("^(a{1000}){1000}$", 1_000_000),
        ("((a{10}){10}){100}", 10_000),
        ("a{2}{3}", 6),
        ("abc{3}", 5),  # a count takes the character before it, not the run
        ("(?:ab|cd){10}", 40),
        ("(a|b{50}){2}", 102),
        ("^(\\d{1,3}\\.){3}\\d{1,3}$", 15),
        ("[a-z]{1,64}", 64),
        ("[]{]{3}", 3),  # a brace in a class is no count
        ("\\p{L}{5}", 5),
        ("x{abc}", 6),  # not a count: literal characters
        ("^.{0,100000}$", 100_000),
    ],
)
def test_a_patterns_expansion_counts_its_repetitions(pattern, size):
    assert expansion(pattern) == size


def test_pattern_bombs_are_refused_without_compiling():
    assert pattern_problem("^[a-z0-9._%+-]+@[a-z0-9.-]+\\.[a-z]{2,}$") is None
    assert pattern_problem("^.{0,%d}$" % MAX_EXPANSION) is None
    problem = pattern_problem("^(a{1000}){1000}$")
    assert "expands to 1,000,000" in problem and f"at most {MAX_EXPANSION:,}" in problem
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": BOMB}}}
    assert "expands to" in schema_pattern_problem(nested)
    assert "expands to" in schema_pattern_problem({"patternProperties": {"(x{400}){400}": {}}})
    assert schema_pattern_problem({"enum": [BOMB], "properties": {"pattern": {"type": "string"}}}) is None  # data
    started = time.perf_counter()
    assert expansion("(" * 20_000 + "a{9}" + "){9}" * 20_000) > MAX_EXPANSION  # linear in the length
    assert time.perf_counter() - started < 1.0
    with pytest.raises(EdgeSpecError, match="^response_format json_schema.schema: the pattern"):
        grammar_for(schema_format(BOMB))


# -- the checker's child process -------------------------------------------------------------------


def test_a_slow_compile_is_ended_at_its_time_limit_and_the_checker_goes_on(checker):
    for index, grammar in enumerate((BOMB_GRAMMAR, grammar_for(schema_format(SLOW)))):
        checker.check(grammar_for(schema_format({**GOOD, "title": str(index)})))  # a child, started apart
        started = time.monotonic()
        with pytest.raises(GrammarRefused, match=f"takes longer than {SHORT:g} s"):
            checker.check(grammar, seconds=SHORT)
        assert time.monotonic() - started < SHORT + 1.0
    checker.check(grammar_for({"type": "json_object"}))  # a new child
    started = time.monotonic()
    with pytest.raises(GrammarRefused, match="takes longer"):  # remembered: no second compile
        checker.check(BOMB_GRAMMAR, seconds=SHORT)
    assert time.monotonic() - started < 0.5
    with pytest.raises(GrammarRefused, match="minLength"):
        checker.check(grammar_for(schema_format(NO_LENGTH)))


def test_a_check_that_cannot_start_in_time_is_busy(checker):
    checker.check(grammar_for(schema_format(GOOD)))
    slow = schema_format({**SLOW, "title": "another"})  # not remembered
    outcome = {}
    # the holder keeps the child for a second (the slow schema's compile takes longer, then fails)
    holder = threading.Thread(target=lambda: outcome.update(error=_refusal(checker, grammar_for(slow), 1.0)))
    holder.start()
    time.sleep(0.4)
    with pytest.raises(CheckerBusy):
        checker.check(grammar_for(schema_format({**GOOD, "title": "new"})), seconds=0.2)
    holder.join(timeout=30)
    assert "takes longer than 1 s" in outcome["error"]


def _refusal(checker: GrammarChecker, grammar: str, seconds: float) -> str:
    try:
        checker.check(grammar, seconds=seconds)
    except GrammarRefused as exc:
        return str(exc)
    return ""


# -- the server ------------------------------------------------------------------------------------


def serving(engine, seconds: float = QUICK) -> TestClient:
    app, state = build_app(engine, name="tiny")
    state.grammar_seconds = seconds
    return TestClient(app, base_url=BASE)


def error(response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


@pytest.mark.parametrize("response_format, fragment", IMPOSSIBLE)
def test_the_server_refuses_impossible_grammars_with_a_400(engine, response_format, fragment):
    with serving(engine) as client:
        chat = client.post(
            "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "response_format": response_format}
        )
        completion = client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 4, "response_format": response_format}
        )
    for response in (chat, completion):
        body = error(response, 400)
        assert body["param"] == "response_format" and fragment in body["message"], body


def test_the_server_refuses_a_slow_grammar_within_its_time_limit(engine):
    schema = SLOW
    with serving(engine) as client:
        warm = client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "response_format": {"type": "json_object"}}
        )
        started = time.monotonic()
        bomb = client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "response_format": schema_format(schema)}
        )
        took = time.monotonic() - started
        after = client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "response_format": schema_format(GOOD)}
        )
    assert warm.status_code == 200, warm.text
    body = error(bomb, 400)
    assert body["param"] == "response_format" and f"takes longer than {QUICK:g} s" in body["message"]
    assert took < QUICK + 2.0, took
    assert after.status_code == 200, after.text


@pytest.mark.parametrize(
    "response_format",
    [schema_format(BOMB), {"type": "regex", "regex": "^(a{1000}){1000}$"}],
    ids=["schema-pattern", "regex"],
)
def test_a_pattern_bomb_is_refused_before_the_checker_sees_it(engine, response_format):
    """Ending the checker's child and starting another costs seconds of CPU: a bomb never gets that far."""
    app, state = build_app(engine, name="tiny")
    state.grammar_seconds = 5.0
    with TestClient(app, base_url=BASE) as client:
        started = time.monotonic()
        bomb = client.post(
            "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "response_format": response_format}
        )
        took = time.monotonic() - started
    body = error(bomb, 400)
    assert body["param"] == "response_format" and "expands to 1,000,000" in body["message"], body
    assert "\n" not in body["message"]
    assert took < 1.0, took
    assert state._checker is None  # no child was started, busied or ended for it


def test_a_prepared_server_builds_nothing_at_its_first_requests(engine):
    """``serve`` prepares its state before it accepts connections: the first constrained request and the
    first ``/tokenize`` then find the vocabulary, the checker's child and the tokenizers ready (building
    them holds the GIL for seconds with a real vocabulary)."""
    app, state = build_app(engine, name="tiny")
    state.prepare()
    checker, tokenizers, pieces = state._checker, state._tokenizers, state._pieces
    assert checker is not None and tokenizers is not None and pieces is not None
    child = checker._child
    assert child is not None and child.process.poll() is None  # started, and running
    with TestClient(app, base_url=BASE) as client:
        answer = client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 2, "response_format": schema_format({**GOOD, "title": "prepared"})},
        )
        tokens = client.post("/tokenize", json={"content": "hello world", "with_pieces": True})
    assert answer.status_code == 200 and tokens.status_code == 200, (answer.text, tokens.text)
    assert state._checker is checker and checker._child is child  # the same child answered
    assert state._tokenizers is tokenizers and state._pieces is pieces


def test_forced_tool_calls_check_their_parameters(tools_bundle):  # noqa: F811
    engine = Engine.from_bundle(tools_bundle, mode="spec", threads=1)

    def tool(parameters: dict) -> dict:
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    with serving(engine) as client:
        answers = {
            name: client.post(
                "/v1/chat/completions",
                json={"messages": ASK, "max_tokens": 8, "tools": [tool(parameters)], "tool_choice": "required"},
            )
            for name, parameters in (
                ("bomb", {"type": "object", "properties": {"a": BOMB}, "required": ["a"]}),
                ("cycle", {"type": "object", **NESTED_CYCLE}),
                ("impossible", {"type": "object", "properties": {"a": NO_LENGTH}, "required": ["a"]}),
            )
        }
    for name, fragment in (
        ("bomb", "expands to 1,000,000"),
        ("cycle", "refers only to itself"),
        ("impossible", "cannot force a call"),
    ):
        body = error(answers[name], 400)
        assert body["param"] == "tools" and fragment in body["message"], (name, body)


def test_health_answers_while_a_grammar_bomb_compiles(engine):
    app, state = build_app(engine, name="tiny")
    state.grammar_seconds = 3.0
    server = helpers.LiveServer(app)
    try:
        outcome = {}

        def post():
            started = time.monotonic()
            outcome["response"] = httpx.post(
                f"{server.url}/v1/completions",
                json={"prompt": "x", "max_tokens": 2, "response_format": schema_format({**SLOW, "title": "live"})},
                timeout=60,
            )
            outcome["took"] = time.monotonic() - started

        thread = threading.Thread(target=post)
        thread.start()
        latencies = []
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while thread.is_alive():
                started = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.02)
        thread.join()
    finally:
        server.stop()
    assert error(outcome["response"], 400)["param"] == "response_format"
    assert len(latencies) > 10 and max(latencies) < 1.0, latencies  # the compile holds no thread here


def test_a_constrained_request_is_compiled_once_and_the_engine_compiles_nothing(engine, monkeypatch):
    """A request's grammar is written once (when its body is read), checked in the child, and compiled once
    in the server's process, by the route; the engine follows that constraint and compiles nothing."""
    import sys

    written, made = [], []
    for module in [m for name, m in sys.modules.items() if name.startswith("edge_spec") and m is not None]:
        if getattr(module, "grammar_for", None) is grammar_for:
            monkeypatch.setattr(module, "grammar_for", lambda fmt: written.append(1) or grammar_for(fmt))
    init = Constraint.__init__
    monkeypatch.setattr(Constraint, "__init__", lambda self, *args: made.append(1) or init(self, *args))
    with serving(engine, seconds=10.0) as client:
        for body in (
            {"prompt": "x", "max_tokens": 3, "response_format": schema_format({**GOOD, "title": "once"})},
            {"messages": CHAT, "max_tokens": 3, "response_format": {"type": "json_object"}},
        ):
            written.clear()
            made.clear()
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            answer = client.post(path, json=body)
            assert answer.status_code == 200, answer.text
            assert written == [1] and made == [1]


def test_a_loop_without_constraints_is_refused_in_the_servers_words_before_any_check(int4_bundle, tools_bundle):  # noqa: F811
    """Multi-draft spec cannot constrain an answer: a 400 naming the field, in the same words as ever,
    before the grammar checker starts."""
    reason = (
        "response_format (constrained output) runs in --mode ar and one-chain spec, not in multi-draft spec "
        "(--drafts > 1) or --mode ssd"
    )
    for bundle, path, body, param in (
        (int4_bundle, "/v1/completions", {"prompt": "x", "response_format": schema_format(GOOD)}, "response_format"),
        (
            int4_bundle,
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": schema_format(GOOD)},
            "response_format",
        ),
        (
            tools_bundle,
            "/v1/chat/completions",
            {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            "tool_choice",
        ),
    ):
        tree = Engine.from_bundle(bundle, threads=1, config=TreeConfig(gamma=2, drafts=2))
        app, state = build_app(tree, name="tiny")
        with TestClient(app, base_url=BASE) as client:
            response = client.post(path, json={**body, "max_tokens": 2})
        assert response.status_code == 400
        assert response.json() == {
            "error": {
                "message": f"'{param}' needs constrained decoding: {reason}",
                "type": "invalid_request_error",
                "param": param,
                "code": None,
            }
        }
        assert state._checker is None
