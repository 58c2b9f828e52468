"""Per-token provenance: which proposer's accepted draft (or the target) each piece of an answer came from.

Asking for it must never change the answer; its pieces must join to exactly the text chunks the engine
yields; in ar mode every token is the target's, and in spec mode each proposer's tokens are the drafts
of it the target accepted, as ``SpecStats`` counts them.
"""

from __future__ import annotations

import collections

import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import loop_config
from edge_spec.runtime.provenance import SourcedText
from edge_spec.runtime.text import StopMatcher, StreamingDetokenizer

PROMPTS = ["hello world", "the cat sat on the mat and the cat sat on the mat and the"]


@pytest.fixture(scope="module")
def engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, mode="spec", threads=1)


@pytest.fixture(scope="module")
def drafting(int4_bundle):
    """The drafter model drafts every round (the adaptive schedule soon stops asking the tiny drafter)."""
    return Engine.from_bundle(int4_bundle, threads=1, config=loop_config("spec", gamma=4, schedule="fixed"))


def generate(engine, prompt, *, sourced, **kwargs):
    """(chunks, pieces per chunk, token ids, stats); pieces None when not asked for."""
    seen: list[list[list[str]]] = []
    chunks = list(engine.generate(prompt, on_sources=seen.append if sourced else None, **kwargs))
    return chunks, (seen if sourced else None), list(engine.last_token_ids), engine.last_stats


@pytest.mark.parametrize("mode", ["ar", "spec"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=7, sampler="coupled")])
def test_provenance_changes_no_token(engine, mode, sampling):
    """Greedy and coupled answers are functions of the prompt and seed alone, so the two runs must agree
    token for token (a rejection-sampled spec answer also depends on the timed schedule's choices)."""
    for prompt in PROMPTS:
        plain, _, plain_ids, plain_stats = generate(
            engine, prompt, sourced=False, mode=mode, max_new_tokens=40, **sampling
        )
        chunks, pieces, ids, stats = generate(engine, prompt, sourced=True, mode=mode, max_new_tokens=40, **sampling)
        assert ids == plain_ids and chunks == plain
        assert stats.stop_reason == plain_stats.stop_reason
        assert len(pieces) in (len(chunks), len(chunks) + 1)  # + the last tokens, when their text is empty
        for chunk, chunk_pieces in zip(chunks + [""], pieces):  # each chunk's pieces spell it out
            assert "".join(text for text, _ in chunk_pieces) == chunk


def test_ar_tokens_are_all_the_target_s(engine):
    _, pieces, ids, _ = generate(engine, PROMPTS[1], sourced=True, mode="ar", max_new_tokens=40)
    sources = [source for chunk in pieces for _, source in chunk]
    assert len(sources) == len(ids) and set(sources) == {"target"}


@pytest.mark.parametrize("schedule", ["adaptive", "fixed"])
def test_spec_sources_match_the_accepted_drafts(engine, drafting, schedule):
    engine = drafting if schedule == "fixed" else engine
    totals: collections.Counter[str] = collections.Counter()
    for prompt in PROMPTS + ["def is_prime(n):"]:
        _, pieces, ids, stats = generate(
            engine,
            prompt,
            sourced=True,
            mode="spec",
            max_new_tokens=60,
        )
        assert stats.stop_reason == "length"  # every token of every round was emitted
        counts = collections.Counter(source for chunk in pieces for _, source in chunk)
        assert sum(counts.values()) == len(ids) == stats.new_tokens  # one piece per token
        spec = stats.spec
        for source, tally in spec.sources.items():
            assert counts.get(source, 0) == tally.accepted, source
        assert sum(n for source, n in counts.items() if source != "target") == sum(spec.accepted_lengths)
        assert counts["target"] == spec.target_calls + 1  # a correction/bonus per pass, and the first token
        totals.update(counts)
    assert totals["target"] > 0
    if schedule == "fixed":
        assert totals["model"] > 0  # the tiny drafter's drafts are accepted, not all of them


def test_forced_grammar_tokens_are_named(drafting):
    engine = drafting
    schema = {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {
                "type": "object",
                "properties": {"answer": {"type": "string"}},
                "required": ["answer"],
                "additionalProperties": False,
            },
        },
    }
    plain, _, plain_ids, _ = generate(
        engine, "hello", sourced=False, mode="spec", max_new_tokens=30, response_format=schema
    )
    chunks, pieces, ids, stats = generate(
        engine, "hello", sourced=True, mode="spec", max_new_tokens=30, response_format=schema
    )
    assert ids == plain_ids and chunks == plain
    counts = collections.Counter(source for chunk in pieces for _, source in chunk)
    assert counts["forced"] == stats.spec.tally("forced").accepted > 0


class _Bytes:
    """A tokenizer stand-in over raw UTF-8 bytes: token i is byte i (what byte-level BPE falls back to)."""

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")  # past 255: no text


def test_a_character_split_across_tokens_goes_to_the_token_completing_it():
    text = SourcedText(_Bytes())
    data = "aé€b".encode()  # é: 2 bytes, €: 3 bytes
    sources = ["target", "model", "model", "lookup", "lookup", "target", "model"]
    deltas = [text.push(byte, source) for byte, source in zip(data, sources)]
    plain = StreamingDetokenizer(_Bytes())
    assert deltas == [plain.push(byte) for byte in data]  # the same deltas as the plain detokenizer
    assert deltas == ["a", "", "é", "", "", "€", "b"]
    assert text.take(1) == [["a", "target"]]
    assert text.take(1) == [["", "model"], ["é", "model"]]
    assert text.take(2) == [["", "lookup"], ["", "lookup"], ["€", "target"], ["b", "model"]]
    assert text.take(0) == []


def test_a_stop_hold_back_splits_a_token_across_hand_outs():
    text = SourcedText(_Bytes())
    stopper = StopMatcher(["xyz"])
    out = []
    for piece, source in [(b"ab", "model"), (b"cx", "target"), (b"y!", "lookup")]:
        delta = "".join(text.push(byte, source) for byte in piece)
        released, stopped = stopper.feed(delta)
        assert not stopped
        out.append(text.take(len(released)))
    assert out == [
        [["a", "model"], ["b", "model"]],
        [["c", "target"]],
        [["x", "target"], ["y", "lookup"], ["!", "lookup"]],
    ]


def test_tokens_without_text_at_the_end_are_handed_out_with_the_rest():
    text = SourcedText(_Bytes())
    assert [
        text.push(token, source) for token, source in [(97, "target"), (300, "model"), (98, "lookup"), (301, "guess")]
    ] == ["a", "", "b", ""]
    assert text.flush() == ""
    assert text.take(1) == [["a", "target"]]
    assert text.take(1) == [["", "model"], ["b", "lookup"]]  # a token without text goes with the next text
    assert text.waiting() and text.take_rest() == [["", "guess"]]
    assert not text.waiting()
