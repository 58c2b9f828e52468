"""Structured output under speculative decoding, on the tiny models: every verified position's target
distribution is masked to what the grammar allows, drafts are drawn from masked drafter distributions,
forced tokens are drafted for free, and the constraint rolls back with the caches.  Lossless means
constrained speculative decoding gives constrained target-only decoding's output: token for token when
greedy, in distribution when sampling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain import Constraint, ConstraintViolation, GrammarVocabulary, grammar_for
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops import ConstraintUnsupported
from edge_spec.runtime.loops.config import ArConfig, ChainConfig, SsdConfig, TreeConfig
from edge_spec.runtime.loops.stats import SpecStats
from edge_spec.runtime.propose.context import ProposerContext
from edge_spec.runtime.propose.model import drafter_probs
from edge_spec.runtime.verify.sampling import SamplingParams, scatter_probs
from tests.helpers import PROMPTS, chain, chi_square_same_distribution, loop_tokens

# fixed keys (forced runs), an enum, a boolean, a bounded integer and a short string: every answer ends
SCHEMA = {
    "type": "object",
    "properties": {
        "speculative_language": {"enum": ["python", "french", "arithmetic", "summary"]},
        "verdict_is_correct": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["speculative_language", "verdict_is_correct", "count", "note"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}, "whitespace": "compact"}
# free choices from the first tokens on (for the distribution tests)
CHOICES = {
    "type": "json_schema",
    "whitespace": "compact",
    "json_schema": {
        "schema": {"type": "array", "minItems": 2, "items": {"enum": ["fox", "dog", "prime", "lazy", "brown", "quick"]}}
    },
}


@pytest.fixture(scope="module")
def engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="full")


@pytest.fixture(scope="module")
def vocabulary(engine):
    return GrammarVocabulary(
        engine.bundle.tokenizer.tokenizer, engine.bundle.target.vocab_size, engine.bundle.tokenizer.eos_token_ids
    )


def new_constraint(vocabulary, response_format=FORMAT) -> Constraint:
    return Constraint(grammar_for(response_format), vocabulary)


def run(
    engine, vocabulary, prompt_ids, params, n, config, seed=0, response_format=FORMAT, proposers=None, constraint=None
):
    """Tokens of one constrained generation up to the first end token (included), and the loop's stats."""
    stats = None if config is None else SpecStats()
    drafters = {} if config is None else {"model": engine.bundle.drafter}
    if proposers is not None:
        drafters["model"] = proposers
    context = ProposerContext(engine.bundle.target.vocab_size, drafters)
    constraint = constraint or new_constraint(vocabulary, response_format)
    tokens = []
    for token in loop_tokens(
        config or ArConfig(),
        engine.bundle.target,
        context,
        prompt_ids,
        params,
        np.random.default_rng(seed),
        n,
        stats,
        constraint=constraint,
    ):
        tokens.append(token)
        if token in engine.bundle.tokenizer.eos_token_ids:
            break
    return tokens, stats


def answer(engine, tokens) -> dict:
    assert tokens[-1] in engine.bundle.tokenizer.eos_token_ids, "the answer did not finish"
    return json.loads(engine.bundle.tokenizer.decode(tokens[:-1]))


def conforms(value, schema) -> bool:
    """The subset of JSON Schema these tests use (kept independent of the grammar library)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        return (
            isinstance(value, dict)
            and set(schema["required"]) <= set(value)
            and (schema.get("additionalProperties", True) or set(value) <= set(schema["properties"]))
            and all(conforms(v, schema["properties"][k]) for k, v in value.items())
        )
    if kind == "array":
        return isinstance(value, list) and all(conforms(v, schema["items"]) for v in value)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and schema.get("minimum", value) <= value <= schema.get("maximum", value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    raise AssertionError(f"schema type {kind} not covered")


def test_the_validator_rejects_what_the_schema_excludes():
    good = {"speculative_language": "python", "verdict_is_correct": True, "count": 7, "note": "ok"}
    assert conforms(good, SCHEMA)
    for change in (
        {"speculative_language": "go"},
        {"verdict_is_correct": 1},
        {"count": 100},
        {"note": "toolong"},
        {"extra": 1},
    ):
        assert not conforms({**good, **change}, SCHEMA)
    assert not conforms({k: v for k, v in good.items() if k != "count"}, SCHEMA)


@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_greedy_constrained_speculative_equals_constrained_autoregressive(engine, vocabulary, gamma):
    greedy = SamplingParams(end_ids=frozenset(engine.bundle.tokenizer.eos_token_ids))
    engine.bundle.target.min_rows = 2  # the engine's exact passes, as generate sets them in spec mode
    rejected = forced = 0
    for prompt in PROMPTS:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, vocabulary, ids, greedy, 80, None)
        got, stats = run(engine, vocabulary, ids, greedy, 80, chain(gamma))
        assert got == reference, (gamma, prompt)
        assert conforms(answer(engine, got), SCHEMA)
        assert max(stats.drafted) <= gamma
        rejected += sum(d - a for d, a in zip(stats.drafted, stats.accepted))
        forced += stats.tally("forced").drafted
    assert rejected > 0, "no draft was rejected: roll-back of the constraint not exercised"
    assert forced > 0


def test_greedy_constrained_adaptive_with_lookup_equals_autoregressive(engine, vocabulary):
    greedy = SamplingParams(end_ids=frozenset(engine.bundle.tokenizer.eos_token_ids))
    engine.bundle.target.min_rows = 2
    config = ChainConfig(gamma=8, adaptive=True, proposers=("lookup", "model", "guess"))
    for prompt in PROMPTS:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, vocabulary, ids, greedy, 80, None)
        got, _ = run(engine, vocabulary, ids, greedy, 80, config)
        assert got == reference


@pytest.mark.parametrize("head", ["trim-64", "specvocab-r16-k48"])
def test_greedy_constrained_with_reduced_heads_equals_autoregressive(int4_bundle, head):
    """A trimmed head or a SpecVocab head drafts among its rows the grammar allows (none: the block ends)."""
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head=head)
    vocabulary = GrammarVocabulary(
        engine.bundle.tokenizer.tokenizer, engine.bundle.target.vocab_size, engine.bundle.tokenizer.eos_token_ids
    )
    greedy = SamplingParams(end_ids=frozenset(engine.bundle.tokenizer.eos_token_ids))
    engine.bundle.target.min_rows = 2
    for prompt in PROMPTS:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, vocabulary, ids, greedy, 80, None)
        got, stats = run(engine, vocabulary, ids, greedy, 80, chain(3))
        assert got == reference, (head, prompt)


def test_coupled_constrained_speculative_is_constrained_ar_with_the_same_seed(engine, vocabulary):
    """Coupled sampling fixes each token by (seed, position) on the masked distribution: spec must give
    target-only decoding's very answer, sampled, for every seed."""
    differs = 0
    for seed in range(6):
        params = SamplingParams(
            temperature=1.0, seed=seed, sampler="coupled", end_ids=frozenset(engine.bundle.tokenizer.eos_token_ids)
        )
        ids = engine.bundle.tokenizer.encode(PROMPTS[seed % len(PROMPTS)])
        reference, _ = run(engine, vocabulary, ids, params, 80, None)
        got, _ = run(engine, vocabulary, ids, params, 80, chain(3), seed=seed + 100)
        assert got == reference
        assert conforms(answer(engine, got), SCHEMA)
        greedy, _ = run(engine, vocabulary, ids, SamplingParams(end_ids=params.end_ids), 80, None)
        differs += got != greedy
    assert differs > 0, "sampling never left the greedy answer: the test would not tell them apart"


def test_unconstrained_answers_break_the_schema(engine, vocabulary):
    """Negative control for the checks above: the same prompts without a constraint are no such JSON."""
    from tests.helpers import run as plain_run

    for prompt in PROMPTS:
        tokens, _ = plain_run(engine, engine.bundle.tokenizer.encode(prompt), SamplingParams(), 40, None)
        with pytest.raises(ValueError):
            json.loads(engine.bundle.tokenizer.decode(tokens))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tokens_are_drafted_for_free_and_always_accepted(engine, vocabulary, temperature):
    params = SamplingParams(temperature=temperature, end_ids=frozenset(engine.bundle.tokenizer.eos_token_ids))
    emitted = from_forced = 0
    for seed, prompt in enumerate(PROMPTS):
        tokens, stats = run(engine, vocabulary, engine.bundle.tokenizer.encode(prompt), params, 80, chain(4), seed=seed)
        forced = stats.tally("forced")
        assert forced.rounds > 0 and forced.accepted == forced.drafted
        emitted += len(tokens)
        from_forced += forced.accepted
        assert stats.draft_steps >= 0
    assert from_forced / emitted > 0.4, (from_forced, emitted)


def test_without_forced_drafts_the_keys_cost_drafter_steps(engine, vocabulary, monkeypatch):
    """Control for the share above: the same answers drafted by the model alone take more drafter steps."""
    greedy = SamplingParams(end_ids=frozenset(engine.bundle.tokenizer.eos_token_ids))
    ids = engine.bundle.tokenizer.encode(PROMPTS[0])
    with_forced, stats = run(engine, vocabulary, ids, greedy, 80, chain(4))
    monkeypatch.setattr(Constraint, "forced_tokens", lambda self: [])
    alone, alone_stats = run(engine, vocabulary, ids, greedy, 80, chain(4))
    assert alone == with_forced
    assert alone_stats.tally("forced").drafted == 0
    assert alone_stats.draft_steps > stats.draft_steps
    assert len(alone_stats.accepted) >= len(stats.accepted)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_constraint_rolls_back_with_the_caches(engine, vocabulary, temperature):
    """Whenever the emitted tokens catch up with what the constraint consumed, its state is that of a fresh
    constraint advanced over exactly those tokens (masks, forced tokens, finished), across rejections."""
    params = SamplingParams(temperature=temperature, end_ids=frozenset(engine.bundle.tokenizer.eos_token_ids))
    checked = 0
    rejections = 0
    for seed, prompt in enumerate(PROMPTS):
        c = new_constraint(vocabulary)
        stats = SpecStats()
        context = ProposerContext(engine.bundle.target.vocab_size, {"model": engine.bundle.drafter})
        emitted = []
        for token in loop_tokens(
            chain(4),
            engine.bundle.target,
            context,
            engine.bundle.tokenizer.encode(prompt),
            params,
            np.random.default_rng(seed),
            80,
            stats,
            constraint=c,
        ):
            emitted.append(token)
            if len(c.tokens) == len(emitted):
                assert c.tokens == emitted
                fresh = new_constraint(vocabulary)
                for t in emitted:
                    fresh.advance(t)
                np.testing.assert_array_equal(c.allowed(), fresh.allowed())
                assert c.forced_tokens() == fresh.forced_tokens()
                assert c.is_finished() == fresh.is_finished()
                checked += 1
            if token in params.end_ids:
                break
        rejections += sum(d - a for d, a in zip(stats.drafted, stats.accepted))
    assert rejections > 0 and checked > 10


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_state_of_the_grammar_is_masked_once_a_round(engine, vocabulary, monkeypatch, temperature):
    """The grammar is walked once per round: the drafter's masked steps are the verifier's, so no state
    (the tokens consumed) has its mask computed by the grammar engine twice, rejections included; and the
    answers stay those of constrained target-only decoding."""
    params = SamplingParams(temperature=temperature, end_ids=frozenset(engine.bundle.tokenizer.eos_token_ids))
    engine.bundle.target.min_rows = 2
    masked: list[tuple[int, ...]] = []
    library_allowed = Constraint.library_allowed

    def counted(self):
        masked.append(tuple(self.tokens))
        return library_allowed(self)

    rejections = steps = 0
    for seed, prompt in enumerate(PROMPTS):
        ids = engine.bundle.tokenizer.encode(prompt)
        with monkeypatch.context() as patch:
            patch.setattr(Constraint, "forced_tokens", lambda self: [])  # every draft a drafter step
            patch.setattr(Constraint, "library_allowed", counted)
            masked.clear()
            got, stats = run(engine, vocabulary, ids, params, 60, chain(4), seed=seed)
        assert masked and len(set(masked)) == len(masked), prompt
        rejections += sum(d - a for d, a in zip(stats.drafted, stats.accepted))
        steps += stats.draft_steps
        if temperature == 0:
            reference, _ = run(engine, vocabulary, ids, params, 60, None)
            assert got == reference
    assert rejections > 0 and steps > 10


# ---------------------------------------------------------------------------
# sampled distribution
# ---------------------------------------------------------------------------


class UnmaskedQ:
    """Negative control: drafts drawn from the masked drafter distribution, but the q rows handed to the
    verifier are the drafter's unmasked ones (a loop that forgot to mask q for the accept test)."""

    def __init__(self, drafter):
        self.inner = drafter
        self.name, self.kind = drafter.name, drafter.kind

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, committed, room, rule):
        block = self.inner.propose(committed, room, rule)
        if block.q_rows:
            rows = []
            for i in range(len(block.tokens)):
                logits, ids = self.inner.next_logits(committed + block.tokens[:i])
                probs = drafter_probs(logits, rule.params)
                rows.append(probs if ids is None else scatter_probs(probs, ids, self.inner.vocab_size))
            block.q_rows = rows
        return block


def first_constrained(engine, vocabulary, params, config, n_samples, n_tokens, seed_offset=0, proposers=None):
    ids = engine.bundle.tokenizer.encode("The quick")
    return [
        tuple(
            run(
                engine,
                vocabulary,
                ids,
                params,
                n_tokens,
                config,
                seed=seed,
                response_format=CHOICES,
                proposers=proposers,
            )[0]
        )
        for seed in range(seed_offset, seed_offset + n_samples)
    ]


N_TOKENS = 8  # '[' is the target's choice, '"' forced; the tokens after them choose among the enum's words


@pytest.mark.slow
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=1.5, top_k=5, top_p=0.99)])
def test_sampled_constrained_speculative_follows_the_masked_target(engine, vocabulary, monkeypatch, settings):
    params = SamplingParams(**settings, end_ids=frozenset(engine.bundle.tokenizer.eos_token_ids))
    n = 1500
    ar = first_constrained(engine, vocabulary, params, None, n, N_TOKENS)
    assert len(set(ar)) >= 5, "too few outcomes for a distribution test"
    spec = first_constrained(engine, vocabulary, params, chain(3), n, N_TOKENS, seed_offset=10**6)
    assert chi_square_same_distribution(ar, spec) > 1e-3

    # Forced drafts end at each choice, where the target samples the bonus token itself; without them the
    # drafter drafts the choices too, from its masked q.
    monkeypatch.setattr(Constraint, "forced_tokens", lambda self: [])
    drafted = first_constrained(engine, vocabulary, params, chain(3), n, N_TOKENS, seed_offset=2 * 10**6)
    assert chi_square_same_distribution(ar, drafted) > 1e-3

    # negative control (a): masked drafts judged against the unmasked q must fail the same test (or, where
    # top-k cut the unmasked q below the drafted token, be refused by the verifier outright)
    try:
        broken = first_constrained(
            engine,
            vocabulary,
            params,
            chain(3),
            n,
            N_TOKENS,
            seed_offset=3 * 10**6,
            proposers=UnmaskedQ(engine.bundle.drafter),
        )
    except ValueError as exc:
        assert "zero drafter probability" in str(exc) and params.top_k
    else:
        assert chi_square_same_distribution(ar, broken) < 1e-6


def test_masking_the_drafter_alone_lets_disallowed_tokens_through(engine, vocabulary, monkeypatch):
    """Negative control (b): with the target's rows left unmasked (drafts still masked), corrections and
    bonus tokens come from the unmasked target and break the grammar; the loop's constraint refuses them."""
    import edge_spec.runtime.loops.request as request_module

    params = SamplingParams(temperature=1.0, end_ids=frozenset(engine.bundle.tokenizer.eos_token_ids))
    ids = engine.bundle.tokenizer.encode("The quick")
    for seed in range(5):  # masked: never a violation
        run(engine, vocabulary, ids, params, N_TOKENS, chain(3), seed=seed, response_format=CHOICES)
    monkeypatch.setattr(request_module, "mask_logits", lambda logits, allowed: logits)
    violations = 0
    for seed in range(5):
        with pytest.raises(ConstraintViolation):
            run(engine, vocabulary, ids, params, 40, chain(3), seed=seed, response_format=CHOICES)
        violations += 1
    assert violations == 5


# ---------------------------------------------------------------------------
# the engine's API
# ---------------------------------------------------------------------------


def test_engine_response_format_spec_equals_ar_and_parses(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(3))
    prompt = "def is_prime"  # raw text: chat messages would carry the schema too, past this model's context
    spec = engine.complete(prompt, max_new_tokens=80, response_format=FORMAT)
    assert spec.stats.stop_reason == "eos"
    assert conforms(json.loads(spec.text), SCHEMA)
    ar = engine.complete(prompt, max_new_tokens=80, response_format=FORMAT, mode="ar")
    assert spec.token_ids == ar.token_ids
    assert spec.stats.spec.tally("forced").accepted > 0
    plain = engine.complete(prompt, max_new_tokens=30)
    assert plain.token_ids != spec.token_ids
    obj = engine.complete(prompt, max_new_tokens=60, response_format={"type": "json_object"}, temperature=0.8, seed=3)
    assert obj.text.startswith("{")


def test_engine_refuses_what_it_cannot_constrain(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(3))
    with pytest.raises(EdgeSpecError) as info:
        engine.complete("def", max_new_tokens=5, response_format=FORMAT, mode="ssd")
    assert "response_format" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(EdgeSpecError) as info:
        engine.complete("def", max_new_tokens=5, response_format={"type": "xml"})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config", [TreeConfig(gamma=2, drafts=2), SsdConfig()])
def test_loops_without_constraint_support_are_refused_before_a_compile(engine, monkeypatch, config):
    """The engine decides where its constraint is made, raw or compiled, before anything is compiled."""
    compiled = engine.constraint_for(FORMAT)
    monkeypatch.setattr(Constraint, "__init__", lambda *args: pytest.fail("compiled for a loop that refuses it"))
    for response_format in (FORMAT, compiled):
        with pytest.raises(ConstraintUnsupported) as info:
            engine.constraint_for(response_format, config)
        assert "response_format" in str(info.value) and "\n" not in str(info.value)


def test_a_compiled_constraint_is_followed_as_it_is(int4_bundle, monkeypatch):
    """``generate`` takes a constraint compiled once (what the server hands it) and compiles nothing more:
    the same tokens as from the raw format; one used already, or of another vocabulary, is refused."""
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(3))
    messages = [{"role": "user", "content": "def is_prime"}]
    fmt = {
        "type": "json_schema",
        "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
    raw = engine.complete(messages, max_new_tokens=24, response_format=fmt)
    compiled = engine.constraint_for(fmt)
    made = []
    init = Constraint.__init__
    monkeypatch.setattr(Constraint, "__init__", lambda self, *args: made.append(1) or init(self, *args))
    again = engine.complete(messages, max_new_tokens=24, response_format=compiled)
    assert again.token_ids == raw.token_ids and made == []  # the schema instruction too: the same prompt
    for used in (
        compiled,
        Constraint(grammar_for(fmt), GrammarVocabulary(engine.bundle.tokenizer.tokenizer, 512, [0])),
    ):
        with pytest.raises(EdgeSpecError, match="fresh and of this model's vocabulary"):
            engine.complete(messages, max_new_tokens=4, response_format=used)
