"""The server's token log-probabilities in OpenAI's shapes, read back through the official ``openai`` client:
chat's ``logprobs`` / ``top_logprobs`` (non-streamed, and per chunk when streamed), the legacy completions'
``logprobs`` (tokens, token_logprobs, top_logprobs dicts, text_offset), and the 400s for values out of range.
The numbers are the engine's: greedy spec answers report what ``ar --exact`` reports for the same tokens."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob  # noqa: E402
from openai.types.completion_choice import Logprobs  # noqa: E402

from edge_spec.server.tokens import TokenPieces  # noqa: E402
from tests.helpers import serving  # noqa: E402

NAME = "tiny"
CHAT = [{"role": "user", "content": "What is 12 * 7?"}]
PROMPT = "the cat sat on the mat and the"
TOL = 1e-4


@pytest.fixture(scope="module")
def pieces(engine):
    return TokenPieces(engine.bundle.tokenizer.tokenizer)


def ar_exact(ar_engine, prompt, top, max_tokens):
    """What target-only exact decoding reports for ``prompt`` (the reference): the text and the entries
    handed out with it (``text_offset`` set)."""
    handed = []
    text = "".join(
        ar_engine.generate(prompt, max_new_tokens=max_tokens, logprobs=top, exact=True, on_logprobs=handed.extend)
    )
    assert [e.token_id for e in handed] == ar_engine.last_token_ids
    return text, handed


def text_of(pieces, token_id) -> str:
    piece = pieces.piece(token_id)
    return piece if isinstance(piece, str) else bytes(piece).decode("utf-8", errors="backslashreplace")


def bytes_of(pieces, token_id) -> list[int]:
    piece = pieces.piece(token_id)
    return list(piece.encode()) if isinstance(piece, str) else piece


def spelled(entries) -> str:
    """The text the entries' bytes make (the tiny model writes bytes that are no UTF-8, as the text does)."""
    return b"".join(bytes(t.bytes) for t in entries).decode("utf-8", errors="replace")


def assert_chat_entries(content, entries, pieces, top):
    assert len(content) == len(entries)
    for got, want in zip(content, entries):
        assert isinstance(got, ChatCompletionTokenLogprob)
        assert got.token == text_of(pieces, want.token_id) and got.bytes == bytes_of(pieces, want.token_id)
        assert abs(got.logprob - want.logprob) <= TOL
        assert len(got.top_logprobs) == top
        for alternative, (token_id, logprob) in zip(got.top_logprobs, want.top):
            assert alternative.token == text_of(pieces, token_id)
            assert alternative.bytes == bytes_of(pieces, token_id)
            assert abs(alternative.logprob - logprob) <= TOL
        values = [t.logprob for t in got.top_logprobs]
        assert values == sorted(values, reverse=True) and (not values or got.logprob <= values[0])


# -- chat ------------------------------------------------------------------------------------------------


def test_chat_logprobs_are_the_target_s_and_change_nothing(engine, ar_engine, pieces):
    with serving(engine) as (client, _):
        ask = dict(model=NAME, messages=CHAT, temperature=0, max_tokens=24)
        plain = client.chat.completions.create(**ask)
        answer = client.chat.completions.create(logprobs=True, top_logprobs=3, **ask)
        bare = client.chat.completions.create(logprobs=True, **ask)
    assert plain.choices[0].logprobs is None  # not asked for: null, as OpenAI answers
    assert answer.choices[0].message.content == plain.choices[0].message.content
    text, entries = ar_exact(ar_engine, CHAT, 3, 24)
    assert answer.choices[0].message.content == text
    content = answer.choices[0].logprobs.content
    assert_chat_entries(content, entries, pieces, 3)
    assert spelled(content) == text  # every token of the answer, once
    assert [t.top_logprobs for t in bare.choices[0].logprobs.content] == [[]] * len(content)
    assert [t.logprob for t in bare.choices[0].logprobs.content] == [t.logprob for t in content]


def test_streamed_chat_carries_each_chunk_s_logprobs(engine, ar_engine, pieces):
    with serving(engine) as (client, _):
        stream = client.chat.completions.create(
            model=NAME, messages=CHAT, temperature=0, max_tokens=24, logprobs=True, top_logprobs=2, stream=True
        )
        chunks = [chunk for chunk in stream if chunk.choices]
    text, entries = ar_exact(ar_engine, CHAT, 2, 24)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None
    content, streamed = [], ""
    for chunk in chunks:
        choice = chunk.choices[0]
        delta = choice.delta.content or ""
        streamed += delta
        if delta:  # each text chunk carries the tokens whose text begins in it
            assert choice.logprobs is not None and choice.logprobs.content
            assert spelled(choice.logprobs.content) == delta
        if choice.logprobs is not None:
            content.extend(choice.logprobs.content)
    assert streamed == text
    assert_chat_entries(content, entries, pieces, 2)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ],
)
def test_chat_logprobs_out_of_range_are_refused_naming_the_field(engine, body, param):
    with serving(engine) as (_, http):
        response = http.post("/v1/chat/completions", json={"model": NAME, "messages": CHAT, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_chat_logprobs_at_the_limit_are_answered(engine):
    with serving(engine) as (client, _):
        answer = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=20)
    assert all(len(t.top_logprobs) == 20 for t in answer.choices[0].logprobs.content)


# -- completions --------------------------------------------------------------------------------------


def test_completion_logprobs_in_the_legacy_shape(engine, ar_engine, pieces):
    with serving(engine) as (client, _):
        answer = client.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=20, logprobs=2)
        plain = client.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=20)
    choice = answer.choices[0]
    assert plain.choices[0].logprobs is None and choice.text == plain.choices[0].text
    text, entries = ar_exact(ar_engine, PROMPT, 2, 20)
    assert choice.text == text
    logprobs = choice.logprobs
    assert isinstance(logprobs, Logprobs)
    assert logprobs.tokens == [text_of(pieces, e.token_id) for e in entries]
    assert logprobs.text_offset == [e.text_offset for e in entries]  # where each token's text begins
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    for token, offset, entry in zip(logprobs.tokens, logprobs.text_offset, entries):
        if isinstance(pieces.piece(entry.token_id), str):  # whole characters: the text holds them there, after
            # the U+FFFD of invalid bytes before them (the tiny model writes some), which no character completes
            assert text[offset:].lstrip("\ufffd").startswith(token)
    for got, alternatives, want in zip(logprobs.token_logprobs, logprobs.top_logprobs, entries, strict=True):
        assert abs(got - want.logprob) <= TOL
        expected = {}
        for t, lp in want.top:  # most likely first: a text shared by two tokens keeps the likelier one's
            expected.setdefault(text_of(pieces, t), lp)
        expected.setdefault(text_of(pieces, want.token_id), want.logprob)  # the token itself, as OpenAI adds it
        assert alternatives.keys() == expected.keys() and len(alternatives) <= 3  # tokens of one text share a key
        assert all(abs(alternatives[k] - expected[k]) <= TOL for k in expected)
        assert max(alternatives.values()) >= got


def test_streamed_completion_logprobs_add_up_to_the_answer_s(engine):
    with serving(engine) as (client, _):
        whole = client.completions.create(model=NAME, prompt=PROMPT, temperature=0, max_tokens=20, logprobs=1)
        stream = client.completions.create(
            model=NAME, prompt=PROMPT, temperature=0, max_tokens=20, logprobs=1, stream=True
        )
        chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    tokens, offsets, values = [], [], []
    start = 0
    for choice in chunks:
        if choice.text:  # the tokens whose text begins in this chunk
            assert choice.logprobs.text_offset[0] == start
            assert all(start <= o < start + len(choice.text) for o in choice.logprobs.text_offset)
            start += len(choice.text)
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            offsets += choice.logprobs.text_offset
            values += choice.logprobs.token_logprobs
    assert tokens == whole.choices[0].logprobs.tokens
    assert offsets == whole.choices[0].logprobs.text_offset  # offsets into the whole answer, not the chunk
    assert values == whole.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 2, "echo": True}, "echo"),
    ],
)
def test_completion_logprobs_out_of_range_are_refused(engine, body, param):
    with serving(engine) as (_, http):
        response = http.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_completion_logprobs_zero_reports_the_token_alone(engine):
    with serving(engine) as (client, _):
        answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, logprobs=0)
    logprobs = answer.choices[0].logprobs
    assert [list(d) for d in logprobs.top_logprobs] == [[t] for t in logprobs.tokens]
