"""Chunked prefill: a long prompt is read in passes of at most ``prefill_chunk`` tokens, with the same
logits bit for bit as one pass, progress after each pass, and cancellation between passes."""

from __future__ import annotations

import numpy as np
import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops import request
from edge_spec.runtime.loops.config import SsdConfig, TreeConfig
from edge_spec.runtime.model.decoder import Decoder
from tests.helpers import chain

PROMPT = [int(t) for t in np.random.default_rng(3).integers(5, 300, 23)]


@pytest.mark.parametrize(
    "num_logits, progress",
    [
        (1, [4, 8, 12, 16, 20, 23]),  # 23 tokens: five passes of 4, then the last 3
        (6, [4, 8, 12, 16, 23]),  # the last pass must hold the 6 rows asked for: 7 tokens
    ],
)
def test_chunked_prefill_equals_one_pass_bit_for_bit(target_path, num_logits, progress):
    whole = Decoder(target_path, threads=1, capacity=64)
    expected = whole.prefill(PROMPT, num_logits)["logits"]
    chunked = Decoder(target_path, threads=1, capacity=64)
    chunked.prefill_chunk = 4
    seen: list[tuple[int, int]] = []
    chunked.prefill_listener = lambda done, total: seen.append((done, total))
    got = chunked.prefill(PROMPT, num_logits)["logits"]
    assert got.shape == (num_logits, chunked.vocab_size)
    np.testing.assert_array_equal(got, expected)
    assert chunked.tokens == PROMPT
    assert [done for done, _ in seen] == progress
    assert all(total == len(PROMPT) for _, total in seen)
    assert 1 not in chunked.stats.calls  # never a lone token in a pass: it would round differently
    assert whole.stats.calls == {len(PROMPT): 1}


def test_short_prompt_is_one_pass_without_progress(target_path):
    decoder = Decoder(target_path, threads=1, capacity=64)
    decoder.prefill_chunk = len(PROMPT) - 1  # one more token would leave a lone token: read as one pass
    decoder.prefill_listener = lambda done, total: pytest.fail("no progress for a one-pass prompt")
    decoder.prefill(PROMPT)
    assert decoder.stats.calls == {len(PROMPT): 1}


def test_prefill_reuses_the_cached_prefix_in_chunks(target_path):
    decoder = Decoder(target_path, threads=1, capacity=64)
    decoder.prefill_chunk = 3
    decoder.prefill(PROMPT[:10])
    seen: list[tuple[int, int]] = []
    decoder.prefill_listener = lambda done, total: seen.append((done, total))
    decoder.prefill(PROMPT)
    assert seen == [(3, 13), (6, 13), (9, 13), (13, 13)]  # only the 13 new tokens are read
    assert decoder.tokens == PROMPT


def _small_chunks(engine: Engine, chunk: int) -> None:
    engine.bundle.target.prefill_chunk = chunk
    engine.bundle.drafter.body.prefill_chunk = chunk


CONFIGS = [chain(2), TreeConfig(gamma=2, drafts=2), SsdConfig(gamma=3)]


def _drafter_length_at_first_token(engine: Engine, reference: list[int]) -> int:
    """How many tokens the drafter held when the first token came out; the answer must be ``reference``."""
    drafter = engine.bundle.drafter.body
    drafter.reset()
    engine.bundle.target.reset()
    chunks = engine.generate(PROMPT_TEXT, max_new_tokens=12, exact=True)
    next(chunks)
    at_first = drafter.length
    for _ in chunks:
        pass
    assert engine.last_token_ids == reference
    assert drafter.length > 0
    return at_first


@pytest.mark.parametrize("config", CONFIGS, ids=["chain", "tree", "ssd"])
def test_after_a_long_prompt_the_first_token_comes_before_the_drafter_reads(int4_bundle, config, monkeypatch):
    """Past ``READ_BEFORE_FIRST`` new tokens the first token comes out of the target's prefill alone: the
    drafter reads the prompt after it is given, and the answer stays the target's."""
    engine = Engine.from_bundle(int4_bundle, threads=1, config=config)
    reference = engine.complete(PROMPT_TEXT, max_new_tokens=12, mode="ar", exact=True).token_ids
    monkeypatch.setattr(request, "READ_BEFORE_FIRST", len(engine.prompt_ids(PROMPT_TEXT)) - 1)
    assert _drafter_length_at_first_token(engine, reference) == 0


@pytest.mark.parametrize("config", CONFIGS, ids=["chain", "tree", "ssd"])
def test_after_a_short_prompt_the_drafter_reads_before_the_first_token(int4_bundle, config, monkeypatch):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=config)
    reference = engine.complete(PROMPT_TEXT, max_new_tokens=12, mode="ar", exact=True).token_ids
    monkeypatch.setattr(request, "READ_BEFORE_FIRST", len(engine.prompt_ids(PROMPT_TEXT)))
    assert _drafter_length_at_first_token(engine, reference) > 0


def test_the_new_tokens_decide_not_the_prompt_length(int4_bundle, monkeypatch):
    """A conversation's next turn brings few new tokens however long it is: the drafter reads it first."""
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2))
    reference = engine.complete(PROMPT_TEXT, max_new_tokens=12, mode="ar", exact=True).token_ids
    monkeypatch.setattr(request, "READ_BEFORE_FIRST", 2)
    engine.bundle.target.reset()
    engine.bundle.target.prefill(engine.prompt_ids(PROMPT_TEXT)[:-2])
    engine.bundle.drafter.body.reset()
    chunks = engine.generate(PROMPT_TEXT, max_new_tokens=12, exact=True)
    next(chunks)
    assert engine.bundle.drafter.body.length > 0
    for _ in chunks:
        pass
    assert engine.last_token_ids == reference


def test_after_a_long_prompt_a_one_token_answer_never_runs_the_drafter(int4_bundle, monkeypatch):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2))
    monkeypatch.setattr(request, "READ_BEFORE_FIRST", 0)
    engine.bundle.drafter.body.reset()
    engine.complete(PROMPT_TEXT, max_new_tokens=1)
    assert engine.bundle.drafter.body.length == 0


@pytest.mark.parametrize("mode", ["spec", "ar"])
def test_engine_reports_one_growing_fraction_and_keeps_greedy_identity(int4_bundle, mode):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    reference = engine.complete(PROMPT_TEXT, max_new_tokens=16, mode="ar", exact=True).token_ids
    _small_chunks(engine, 5)
    engine.bundle.target.reset()
    engine.bundle.drafter.body.reset()
    fractions: list[float] = []
    got = engine.complete(PROMPT_TEXT, max_new_tokens=16, mode=mode, exact=True, on_prefill=fractions.append)
    assert got.token_ids == reference
    assert fractions and fractions == sorted(fractions) and 0 < fractions[0] and fractions[-1] == pytest.approx(1.0)
    assert len(fractions) == -(-len(engine.prompt_ids(PROMPT_TEXT)) // 5)  # the target's passes alone
    assert engine.bundle.target.prefill_listener is None and engine.bundle.drafter.body.prefill_listener is None


def test_cancel_stops_between_prefill_passes(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2))
    _small_chunks(engine, 4)
    fractions: list[float] = []

    def cancel_at_first_pass(fraction: float) -> None:
        fractions.append(fraction)
        engine.cancel()

    got = engine.complete(PROMPT_TEXT, max_new_tokens=8, on_prefill=cancel_at_first_pass)
    assert got.token_ids == [] and got.stats.stop_reason == "cancelled"
    assert len(fractions) == 1
    read = engine.bundle.target.length
    assert 0 < read < len(engine.prompt_ids(PROMPT_TEXT))  # stopped part-way, the cache holds a prefix
    # the next request starts from what was read and answers as if nothing had happened
    again = engine.complete(PROMPT_TEXT, max_new_tokens=8)
    assert again.stats.stop_reason in ("length", "eos")
    fresh = Engine.from_bundle(int4_bundle, threads=1, config=chain(2))
    assert again.token_ids == fresh.complete(PROMPT_TEXT, max_new_tokens=8).token_ids


PROMPT_TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number, iteratively."""\n' * 2


def test_bench_pass_logs_leave_every_prefill_pass_out(int4_bundle):
    """A prompt read in several passes (and, in later modes, mostly from the cached prefix) must not leak
    into the bench's per-answer pass log: one target pass per verify round, one per token in ar."""
    from edge_spec.bench.runs import BenchMode, load_bench_prompts, modes_for, run_bench

    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    _small_chunks(engine, 3)
    prompts = load_bench_prompts(None, ["code"], 1)
    modes = modes_for(engine, ["full"], chain(3)) + [BenchMode("spec@γ2", "full", chain(2))]
    result = run_bench(engine, prompts, modes, temperatures=[0.0], max_new_tokens=12)
    for record in result["records"]:
        calls = sum(c for c, _ in record["target_passes"].values())
        if "tau" in record:
            assert calls == record["target_calls"], record["mode"]
            draft_calls = sum(c for c, _ in record["draft_passes"].values())
            assert draft_calls == record["draft_steps"], record["mode"]  # fixed γ: one drafter pass per draft
        else:  # ar and ar-exact: the first token comes out of the prefill, then one pass per token
            assert calls == record["new_tokens"] - 1, record["mode"]
    assert engine.bundle.target.stats.prefill_calls.get(3, 0) > 0  # the prompt did go in several passes
