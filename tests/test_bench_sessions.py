"""Session workloads: the file format and how each request is built (``bench.sessions``), and
``edge-spec bench --sessions`` replaying them on the tiny bundle (``bench.session_runs``)."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
from typer.testing import CliRunner

from edge_spec.bench.session_runs import mismatches, run_sessions, session_modes
from edge_spec.bench.sessions import (
    DEFAULT_SESSIONS,
    PLACEHOLDER,
    answer_code,
    load_sessions,
    select_sessions,
    turn_messages,
)
from edge_spec.cli import app
from edge_spec.errors import EdgeSpecError
from edge_spec.manifest import read_manifest, tokenizer_record, write_manifest
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.text import TextTokenizer
from tests.chat_templates import QWEN25_SHORT

TOOLS = [{"type": "function", "function": {"name": "run_tests"}}]  # short: the tiny context holds 256 tokens


def session(**changes) -> dict:
    """A valid session: two user turns with history, no tools."""
    base = {
        "id": "s",
        "category": "chat",
        "history": True,
        "system": "Be brief.",
        "tools": None,
        "max_tokens": 16,
        "turns": [
            {"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "user", "content": "more"}]},
        ],
    }
    return {**base, **changes}


def write(path, *items) -> str:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))
    return str(path)


# -- building the requests ----------------------------------------------------------------------------


def test_history_carries_earlier_turns_and_the_engine_s_own_answers(tmp_path):
    agent = session(
        tools=TOOLS,
        turns=[
            {"messages": [{"role": "user", "content": "fix the test"}]},
            {"messages": [{"role": "tool", "name": "run_tests", "content": "1 failed"}]},
            {
                "messages": [
                    {"role": "tool", "name": "run_tests", "content": "ok"},
                    {"role": "tool", "name": "run_tests", "content": "2 passed"},
                ]
            },
        ],
    )
    messages = turn_messages(agent, 2, ["<call 1>", "<call 2>"])
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "fix the test"},
        {"role": "assistant", "content": "<call 1>"},
        {"role": "tool", "name": "run_tests", "content": "1 failed"},
        {"role": "assistant", "content": "<call 2>"},
        {"role": "tool", "name": "run_tests", "content": "ok"},
        {"role": "tool", "name": "run_tests", "content": "2 passed"},
    ]
    assert turn_messages(agent, 0, []) == messages[:2]
    assert turn_messages(agent, 2, ["<call 1>", "<call 2>", "ignored: a later answer"]) == messages
    with pytest.raises(ValueError, match="needs the answers"):
        turn_messages(agent, 2, ["<call 1>"])
    with pytest.raises(IndexError):
        turn_messages(agent, 3, ["a", "b", "c"])


def test_without_history_a_request_is_the_system_prompt_and_its_turn_with_the_previous_code():
    editor = session(
        history=False,
        system=None,
        turns=[
            {"messages": [{"role": "user", "content": "```python\nx = 1\n```\nChange: add y"}]},
            {"messages": [{"role": "user", "content": f"```python\n{PLACEHOLDER}\n```\nChange: add z"}]},
        ],
    )
    answer = "Here is the file:\n```python\nx = 1\ny = 2\n```\nI added y."
    assert turn_messages(editor, 1, [answer]) == [
        {"role": "user", "content": "```python\nx = 1\ny = 2\n```\nChange: add z"}
    ]
    assert editor["turns"][1]["messages"][0]["content"].count(PLACEHOLDER) == 1  # the session is left as it was


@pytest.mark.parametrize(
    "answer, code",
    [
        ("x = 1\n", "x = 1"),  # no fence: the whole answer
        ("```python\nx = 1\n\ny = 2\n```", "x = 1\n\ny = 2"),
        ("Sure:\n```\na\n```\nand the file:\n```py\nb\nc\n```\n", "b\nc"),  # the longest block
        ("```python\nx = 1\ny = 2", "x = 1\ny = 2"),  # cut off by the token limit before its closing fence
    ],
)
def test_the_placeholder_takes_the_code_of_the_answer(answer, code):
    assert answer_code(answer) == code


# -- reading a file -----------------------------------------------------------------------------------


def test_a_session_file_is_read_and_completed(tmp_path):
    minimal = {k: v for k, v in session().items() if k not in ("system", "tools")}
    loaded = load_sessions(write(tmp_path / "s.jsonl", minimal, "", session(id="t", category="edit")))
    assert [s["id"] for s in loaded] == ["s", "t"]
    assert loaded[0]["system"] is None and loaded[0]["tools"] is None


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("{not json", ": invalid JSON ("),
        ("[1, 2]", "expected a session object, not list"),
        (session(id=""), "'id' must be a non-empty string"),
        (session(history="yes"), "(session 's'): 'history' must be true or false"),
        (session(max_tokens=0), "'max_tokens' must be a whole number of at least 1"),
        (session(tools={"name": "x"}), "'tools' must be null or a list"),
        (session(turns=[]), "'turns' must be a non-empty list"),
        (session(turns=[{"messages": []}]), "turn 1 must be an object with a non-empty 'messages' list"),
        (session(turns=[{"messages": [{"role": "robot", "content": "x"}]}]), "turn 1 message 1 needs a 'role'"),
        (session(turns=[{"messages": [{"role": "user"}]}]), "turn 1 message 1 needs a string 'content'"),
        (session(turns=[{"messages": [{"role": "user", "content": PLACEHOLDER}]}]), "no answer comes before it"),
    ],
)
def test_a_malformed_session_is_named_in_one_line(tmp_path, line, fragment):
    path = write(tmp_path / "bad.jsonl", session(id="fine"), line)
    with pytest.raises(EdgeSpecError) as error:
        load_sessions(path)
    message = str(error.value)
    assert "\n" not in message and f"{path} line 2" in message and fragment in message, message


def test_file_level_mistakes(tmp_path):
    with pytest.raises(EdgeSpecError, match="session file not found"):
        load_sessions(tmp_path / "missing.jsonl")
    with pytest.raises(EdgeSpecError, match="has no sessions"):
        load_sessions(write(tmp_path / "empty.jsonl", ""))
    with pytest.raises(EdgeSpecError, match="line 2: session id 's' is used twice"):
        load_sessions(write(tmp_path / "twice.jsonl", session(), session()))


def test_select_sessions_by_category():
    sessions = [session(id=str(i), category=c) for i, c in enumerate(["a", "b", "a", "a"])]
    assert [s["id"] for s in select_sessions(sessions, ["a"], 2)] == ["0", "2"]
    assert [s["id"] for s in select_sessions(sessions, None, 1)] == ["0", "1"]
    with pytest.raises(EdgeSpecError, match="unknown session categories: c"):
        select_sessions(sessions, ["c"], None)


def test_the_shipped_sessions():
    """Nine sessions in five categories, each kind built as its workload needs."""
    sessions = load_sessions()
    assert load_sessions(DEFAULT_SESSIONS) == sessions
    assert Counter(s["category"] for s in sessions) == {"agent": 2, "edit": 2, "tests": 2, "chat": 2, "actions": 1}
    for s in sessions:
        later = [m for turn in s["turns"][1:] for m in turn["messages"]]
        if s["category"] == "agent":  # a tool loop: every later turn brings tool results only
            assert s["history"] and s["tools"] and len(s["turns"]) == 6
            assert {m["role"] for m in later} == {"tool"}
        elif s["category"] == "edit":  # an editor: the current file (the last answer's code) and a change
            assert not s["history"] and s["tools"] is None and len(s["turns"]) == 3
            assert all(PLACEHOLDER in m["content"] for m in later)
            first = s["turns"][0]["messages"][0]["content"]
            assert first.count("\n") >= 130 and s["max_tokens"] >= 1024  # room to write the file again
        elif s["category"] == "actions":  # an editor's command: each request its own code alone, no earlier answer
            assert not s["history"] and s["tools"] is None and len(s["turns"]) >= 3
            assert all(PLACEHOLDER not in m["content"] for turn in s["turns"] for m in turn["messages"])
            assert len(turn_messages(s, 1, ["answer"])) == len(turn_messages(s, 0, [])) == 2  # system + the command
        else:
            assert s["history"] and len(s["turns"]) >= 3 and 128 <= s["max_tokens"] <= 384
        assert len(turn_messages(s, len(s["turns"]) - 1, ["answer"] * len(s["turns"]))) > len(s["turns"][-1])


# -- replaying them on the tiny bundle ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_bundle(int4_bundle, tmp_path_factory):
    """The tiny int4 bundle with a chat template that takes tools (Qwen2.5's markup, shortened)."""
    bundle = tmp_path_factory.mktemp("sessions") / "tools"
    shutil.copytree(int4_bundle, bundle)
    path = bundle / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": QWEN25_SHORT}))
    manifest = read_manifest(bundle)
    manifest["tokenizer"] = tokenizer_record(bundle)
    write_manifest(bundle, manifest)
    return bundle


TINY_SESSIONS = [
    {
        "id": "loop",
        "category": "agent",
        "history": True,
        "system": "You run tools.",
        "tools": TOOLS,
        "max_tokens": 6,
        "turns": [
            {"messages": [{"role": "user", "content": "def is_prime(n):"}]},
            {"messages": [{"role": "tool", "name": "run_tests", "content": "The quick brown fox"}]},
            {"messages": [{"role": "tool", "name": "run_tests", "content": "What is 12 * 7?"}]},
        ],
    },
    {
        "id": "rewrite",
        "category": "edit",
        "history": False,
        "system": None,
        "tools": None,
        "max_tokens": 8,
        "turns": [
            {"messages": [{"role": "user", "content": "def is_prime(n):"}]},
            {"messages": [{"role": "user", "content": f"Again: {PLACEHOLDER}"}]},
        ],
    },
]


def test_bench_sessions_writes_json_and_greedy_answers_equal_ar_exact(tools_bundle, tmp_path):
    path = write(tmp_path / "tiny.jsonl", *TINY_SESSIONS)
    output = tmp_path / "results"
    args = ["bench", str(tools_bundle), "--session-file", path, "--temperature", "0", "--threads", "1"]
    result = CliRunner().invoke(app, [*args, "--draft-head", "trim-64", "--output", str(output)])
    assert result.exit_code == 0 and result.exception is None, (result.exception, result.output)
    assert "spec-nocache" in result.output
    run = json.loads((output / "sessions.json").read_text())
    records = run["records"]
    names = ["ar", "ar-exact", "spec-nocache+trim-64", "spec+trim-64"]
    assert Counter(r["mode"] for r in records) == {name: 5 for name in names}  # 3 + 2 turns each
    assert run["mismatches"] == [] and run["sessions"] == ["loop", "rewrite"]
    speculative = [r for r in records if "tau" in r]
    assert speculative and all(r["identical_to_ar"] for r in speculative)
    # every mode fed its own answers to its later turns: each prompt is rebuilt from them, token for token
    tokenizer = TextTokenizer(tools_bundle)
    for mode in names:
        for tiny in TINY_SESSIONS:
            turns = sorted(
                (r for r in records if r["mode"] == mode and r["session"] == tiny["id"]), key=lambda r: r["turn"]
            )
            answers = [r["answer"] for r in turns]
            for r in turns:
                assert len(r["answer"]) > 0 and r["new_tokens"] <= tiny["max_tokens"]
                ids = tokenizer.encode_chat(turn_messages(tiny, r["turn"], answers), tools=tiny["tools"])
                assert r["prompt_tokens"] == len(ids), (mode, tiny["id"], r["turn"])
    summary = {(r["category"], r["mode"]): r for r in run["summary"]}
    assert {c for c, _ in summary} == {"agent", "edit", "overall"}
    cached = summary[("overall", "spec+trim-64")]
    assert cached["speedup_vs_nocache"] == pytest.approx(
        cached["tokens_per_second"] / summary[("overall", "spec-nocache+trim-64")]["tokens_per_second"]
    )
    # --max-tokens, when given, caps every turn
    capped = CliRunner().invoke(app, [*args, "--modes", "ar,spec", "--max-tokens", "2", "--output", str(output)])
    assert capped.exit_code == 0, (capped.exception, capped.output)
    records = json.loads((output / "sessions.json").read_text())["records"]
    default = read_manifest(tools_bundle)["draft"]["default_head"]  # sessions run the default head unless named
    assert {r["mode"] for r in records} == {"ar", f"spec+{default}"} and max(r["new_tokens"] for r in records) <= 2


@pytest.mark.parametrize("warm, clears", [(False, 4 * 2), (True, 4)])
def test_each_session_starts_on_an_empty_cache_unless_warm(tools_bundle, monkeypatch, warm, clears):
    """Cold: the cache is emptied before every session in every mode (ar, ar-exact, spec-nocache, spec:
    all on the engine here), so a session drafts from itself alone; warm: once per mode, the sessions
    after the first drafting from the earlier ones too."""
    engine = Engine.from_bundle(tools_bundle, threads=1)
    held, prompts = [], []
    clear, reset = engine.bundle.suffix_cache.clear, engine.bundle.target.reset
    monkeypatch.setattr(
        engine.bundle.suffix_cache, "clear", lambda: (held.append(engine.bundle.suffix_cache.tokens), clear())
    )
    monkeypatch.setattr(
        engine.bundle.target, "reset", lambda: (prompts.append(len(engine.bundle.target.tokens)), reset())
    )
    modes = session_modes(engine, ["trim-64"])
    result = run_sessions(engine, TINY_SESSIONS, modes, temperatures=[0.0], warm=warm, max_new_tokens=4)
    assert [m.name for m in modes] == ["ar", "ar-exact", "spec-nocache+trim-64", "spec+trim-64"]
    assert len(held) == clears and len(prompts) == clears  # the KV cache forgets the last prompt with it
    assert all(r["identical_to_ar"] for r in result["records"] if "tau" in r)
    assert held[0] == 0 and all(tokens > 0 for tokens in held[1:])  # each pass left answers behind


def test_bench_sessions_refuses_what_it_cannot_run(int4_bundle, tmp_path):
    def refused(*args: str) -> str:
        result = CliRunner().invoke(app, ["bench", str(int4_bundle), *args])
        assert isinstance(result.exception, EdgeSpecError), (result.exception, result.output)
        return str(result.exception)

    assert "--modes ssd applies to prompts" in refused("--sessions", "--modes", "ar,ssd")
    assert refused("--sessions", "--sweep", "2") == "--sweep applies to prompt benchmarks, not --sessions"
    assert refused("--modes", "ar,nocache") == "--modes nocache applies to --sessions"
    assert "unknown session categories: nope" in refused("--sessions", "--category", "nope")
    bad = write(tmp_path / "bad.jsonl", "{oops")
    assert refused("--session-file", bad).startswith(f"{bad} line 1: invalid JSON")
    tiny = write(tmp_path / "tiny.jsonl", *TINY_SESSIONS)  # the tiny bundle's own template takes no tools
    assert refused("--session-file", tiny, "--threads", "1") == (
        "session 'loop' passes tools, but this model's chat template takes no tools (leave its category out: --category)"
    )


def test_a_greedy_answer_that_differs_from_ar_exact_is_named_by_its_first_turn():
    def record(mode, session, turn, same):
        return {"temperature": 0.0, "mode": mode, "session": session, "turn": turn, "identical_to_ar": same}

    records = [
        record("spec", "edit", 2, False),
        record("spec", "edit", 1, False),
        record("spec", "edit", 0, True),
        record("spec", "chat", 0, True),
        record("spec-nocache", "edit", 1, True),
        record("ar", "edit", 0, None),
    ]
    assert mismatches(records) == ["T=0.0: spec answered turn 2 of session 'edit' differently from ar-exact"]


def test_bench_sessions_fails_loudly_on_a_mismatch(tools_bundle, tmp_path, monkeypatch):
    import edge_spec.bench.session_runs

    line = "T=0.0: spec answered turn 2 of session 'loop' differently from ar-exact"
    monkeypatch.setattr(edge_spec.bench.session_runs, "mismatches", lambda records: [line])
    path = write(tmp_path / "tiny.jsonl", *TINY_SESSIONS)
    output = tmp_path / "results"
    args = [
        "--session-file",
        path,
        "--temperature",
        "0",
        "--threads",
        "1",
        "--max-tokens",
        "2",
        "--output",
        str(output),
    ]
    result = CliRunner().invoke(app, ["bench", str(tools_bundle), *args])
    assert result.exit_code == 1 and f"NOT LOSSLESS {line}" in result.output, result.output
    assert json.loads((output / "sessions.json").read_text())["mismatches"] == [line]  # the results are kept
