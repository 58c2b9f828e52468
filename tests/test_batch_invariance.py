"""Batch-invariant target passes (``Decoder(min_rows=2)``): every position's logits depend on the token
sequence only, not on how it was split into passes, so greedy speculative decoding equals greedy
target-only decoding bit for bit (see the ``decoder`` module docstring for why one-row passes differ)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import SsdConfig
from edge_spec.runtime.model.decoder import Decoder
from tests.helpers import PROMPTS, chain, chi_square_same_distribution, first_tokens, guesses_only, run

PROMPT = [5, 17, 42, 99, 7, 3, 250, 61]
CONTINUATION = [11, 12, 301, 77, 8, 8, 140, 33, 21, 9, 300, 4]


def logits_by_chunks(decoder: Decoder, chunks: list[int]) -> np.ndarray:
    """Feed PROMPT, then CONTINUATION in passes of the given sizes; the logits of every continuation position."""
    decoder.reset()
    decoder.forward(PROMPT, 1)
    rows, start = [], 0
    for size in chunks:
        rows.append(decoder.forward(CONTINUATION[start : start + size], size)["logits"])
        assert decoder.length == len(PROMPT) + start + size  # the padding row is not part of the sequence
        start += size
    assert start == len(CONTINUATION)
    return np.concatenate(rows)


def test_padded_one_token_passes_equal_multi_token_passes_bit_for_bit(target_path):
    decoder = Decoder(target_path, threads=1, capacity=64, min_rows=2)
    one_by_one = logits_by_chunks(decoder, [1] * 12)
    mixed = logits_by_chunks(decoder, [3, 1, 2, 4, 1, 1])
    pairs = logits_by_chunks(decoder, [2] * 6)
    assert one_by_one.shape == (12, decoder.vocab_size)
    assert np.array_equal(one_by_one, mixed) and np.array_equal(one_by_one, pairs)


def test_padding_stays_out_of_the_cache(target_path):
    """After padded passes the cache continues exactly like one fed without padding rows in it."""
    padded = Decoder(target_path, threads=1, capacity=64, min_rows=2)
    padded.forward(PROMPT, 1)
    padded.forward([11], 1)
    padded.forward([12], 1)
    plain = Decoder(target_path, threads=1, capacity=64, min_rows=2)
    plain.forward(PROMPT + [11, 12], 1)
    assert padded.tokens == plain.tokens
    np.testing.assert_array_equal(padded.forward([301, 77], 2)["logits"], plain.forward([301, 77], 2)["logits"])


def test_padding_skipped_when_the_context_is_full(target_path):
    decoder = Decoder(target_path, threads=1, capacity=len(PROMPT) + 1, min_rows=2)
    decoder.forward(PROMPT, 1)
    assert decoder.forward([11], 1)["logits"].shape == (1, decoder.vocab_size)  # no room for a pad row
    assert decoder.length == decoder.capacity


def test_one_token_cost_is_the_padded_pass_cost(target_path):
    decoder = Decoder(target_path, threads=1, capacity=64)
    decoder.stats.seed(1, 0.010)
    decoder.stats.seed(2, 0.013)
    assert decoder.recent_seconds()[1] == 0.010
    decoder.min_rows = 2
    assert decoder.recent_seconds()[1] == 0.013  # what the γ policy must plan with for a γ = 0 round


def test_a_lean_one_row_pass_is_priced_at_what_it_costs(target_path):
    """Where one-row passes are exact (``lean_rows`` 1) a round without drafts or guess runs in one row
    although speculative passes pad to two: the cost model must see that row's own price, not the padded
    pass's, or it prices target-only rounds too dear and drafts where drafting loses."""
    decoder = Decoder(target_path, threads=1, capacity=64, min_rows=2)
    decoder.lean_rows = 1
    decoder.stats.seed(1, 0.010)
    decoder.stats.seed(2, 0.013)
    assert decoder.recent_seconds()[1] == 0.010
    decoder.forward(PROMPT, 1)
    for _ in range(3):
        decoder.forward([11], 1, lean=True)
    assert decoder.stats.calls[1] == 3  # lean passes ran in one row and were filed as such
    assert decoder.recent_seconds()[1] == decoder.stats.recent[1] != 0.010
    decoder.lean_rows = None  # control: without exact one-row passes a round is never cheaper than the pad
    padded = decoder.recent_seconds()
    assert padded[1] == padded[2] != decoder.stats.recent[1]


@pytest.mark.parametrize("config", [chain(1), chain(3), chain(4, adaptive=True), chain(2, adaptive=True, lookup=True)])
def test_exact_speculative_equals_exact_target_only(int4_bundle, config):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=config, draft_head="trim-64")
    assert engine.exact_for("spec") and not engine.exact_for("ar")
    for prompt in ("def is_prime", "Summarize: speculative decoding drafts and verifies"):
        reference = engine.complete(prompt, max_new_tokens=24, mode="ar", exact=True).token_ids
        assert engine.complete(prompt, max_new_tokens=24).token_ids == reference
        assert (
            engine.bundle.target.min_rows == engine.bundle.pass_rows("spec") == max(engine.bundle.exact_rows(), 2)
        )  # the guess's row


def test_exact_can_be_turned_off_and_on(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", exact=False)
    assert not engine.exact_for("spec") and engine.exact_for("spec", True)
    engine.complete("def f", max_new_tokens=4)
    assert engine.bundle.target.min_rows == 1
    engine.complete("def f", max_new_tokens=4, mode="ar", exact=True)
    assert (
        engine.bundle.target.min_rows == engine.bundle.exact_rows()
    )  # target-only: 1 where one-row passes were found exact


def test_sampled_speculative_decoding_skips_the_pad_row(int4_bundle):
    """A sampled answer depends on the draft lengths through its random draws, so by default its
    draft-less rounds are plain one-row passes; greedy ones keep the pad row (where this device needs it
    for exactness: ``exact_rows``), and --exact forces it."""
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-64")
    assert engine.exact_for("spec") and not engine.exact_for("spec", deterministic=False)
    engine.complete("def f", max_new_tokens=4, temperature=0.8, seed=1)
    assert engine.bundle.target.min_rows == 1
    engine.complete("def f", max_new_tokens=4)
    assert engine.bundle.target.min_rows == 2
    forced = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-64", exact=True)
    forced.complete("def f", max_new_tokens=4, temperature=0.8, seed=1)
    assert forced.bundle.target.min_rows == 2


@pytest.fixture()
def exact_engine(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="full")
    engine.bundle.target.min_rows = 2
    return engine


def test_draftless_rounds_verify_a_free_guess_in_the_padding_row(exact_engine):
    """γ = 0 rounds pay for two rows anyway: the second row carries a guess and is verified."""
    from edge_spec.runtime.verify.sampling import SamplingParams

    guesses = accepted = 0
    for prompt in PROMPTS:
        ids = exact_engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(exact_engine, ids, SamplingParams(), 40, None)
        got, stats = run(exact_engine, ids, SamplingParams(), 40, guesses_only())
        assert got == reference
        tally = stats.tally("guess")
        assert tally.rounds == len(stats.accepted) - 1  # the last round has no room for a draft
        guesses += tally.rounds
        accepted += tally.accepted
    assert guesses and 0 < accepted < guesses, "guesses were never (or always) accepted: case not exercised"


@pytest.mark.slow
def test_sampled_free_guesses_keep_the_target_distribution(exact_engine):
    from edge_spec.runtime.verify.sampling import SamplingParams

    params = SamplingParams(temperature=1.0)
    ids = exact_engine.bundle.tokenizer.encode("The quick")
    ar = first_tokens(exact_engine, ids, params, None, 1500)
    guessed = first_tokens(exact_engine, ids, params, guesses_only(), 1500, seed_offset=10**6)
    assert chi_square_same_distribution(ar, guessed) > 1e-3


@pytest.mark.parametrize("config", [chain(2), SsdConfig(gamma=1, speculations=0)])
def test_exact_ssd_equals_exact_target_only(exact_engine, config):
    """SSD verifies plain chains, so it is exact like the chain loop (multi-draft trees are not: a
    branch other than the first sits at other cache slots, and attention sums it in another order)."""
    from edge_spec.runtime.verify.sampling import SamplingParams

    for prompt in PROMPTS:
        ids = exact_engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(exact_engine, ids, SamplingParams(), 30, None)
        got, _ = run(exact_engine, ids, SamplingParams(), 30, config)
        assert got == reference, f"{config} {prompt!r}"
