"""Constraints (``runtime.constrain``): what a grammar allows over the target's vocabulary, forced tokens,
roll-back, and the response formats a request may name.  No models: the tiny tokenizer alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain import Constraint, ConstraintViolation, GrammarVocabulary, grammar_for
from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs, mask_logits
from tests import tiny_models

WIDTH = 384  # the tiny target's logits: 64 rows beyond the tokenizer's 320 tokens
EOS = 2  # <|im_end|>
SCHEMA = {
    "type": "object",
    "properties": {"language": {"enum": ["python", "french", "arithmetic"]}, "verdict": {"type": "boolean"}},
    "required": ["language", "verdict"],
    "additionalProperties": False,
}
COMPACT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}, "whitespace": "compact"}


@pytest.fixture(scope="module")
def hf_tokenizer():
    return tiny_models.make_tokenizer()


@pytest.fixture(scope="module")
def vocabulary(hf_tokenizer):
    return GrammarVocabulary(hf_tokenizer.backend_tokenizer, WIDTH, [EOS])


def constraint(vocabulary, response_format=COMPACT) -> Constraint:
    return Constraint(grammar_for(response_format), vocabulary)


def allowed_ids(c: Constraint) -> list[int]:
    return np.flatnonzero(c.allowed()).tolist()


def test_padded_rows_and_pad_named_tokens_are_never_allowed(hf_tokenizer):
    """Inside a JSON string any text goes, so a vocabulary entry spelled ``[PAD330]`` (what GGUF conversion
    names the rows past the real vocabulary) would pass the grammar: it must not pass the constraint, nor
    may ids past the tokenizer's vocabulary."""
    string_format = {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}}
    plain = Constraint(grammar_for(string_format), GrammarVocabulary(hf_tokenizer.backend_tokenizer, WIDTH, [EOS]))
    plain.advance(hf_tokenizer.convert_tokens_to_ids('"'))
    inside = plain.allowed()
    assert inside.shape == (WIDTH,) and inside.dtype == bool
    assert inside[3:320].sum() > 200  # ordinary text tokens are allowed in a string
    assert not inside[320:].any()

    data = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    data["model"]["vocab"].update({f"[PAD{i}]": i for i in range(320, WIDTH)})
    from tokenizers import Tokenizer

    padded = GrammarVocabulary(Tokenizer.from_str(json.dumps(data)), WIDTH, [EOS])
    assert padded.usable[:320].all() and not padded.usable[320:].any()
    c = Constraint(grammar_for(string_format), padded)
    c.advance(hf_tokenizer.convert_tokens_to_ids('"'))
    assert c.allowed()[3:320].sum() == inside[3:320].sum()
    assert not c.allowed()[320:].any()
    # negative control: the grammar library alone lets the pad-named entries through
    assert c.library_allowed()[320:].all()


def test_fixed_keys_are_forced_and_the_mask_there_is_that_token_alone(vocabulary, hf_tokenizer):
    c = constraint(vocabulary)
    forced = c.forced_tokens()
    assert hf_tokenizer.decode(forced) == '{"language":"'
    for token in forced:
        assert allowed_ids(c) == [token]
        c.advance(token)
    assert c.forced_tokens() == []  # the enum's value is a choice
    choices = allowed_ids(c)
    assert len(choices) > 1 and EOS not in choices
    c.advance(hf_tokenizer.convert_tokens_to_ids("p"))
    assert hf_tokenizer.decode(c.forced_tokens()) == 'ython","verdict":'


def test_masks_of_a_walk_are_kept_and_a_rollback_restores_the_mask_there(vocabulary, hf_tokenizer, monkeypatch):
    """The masks computed along a walk come back from ``masks`` without the grammar engine computing them
    again, a roll-back restores the mask of the state it returns to, and masks never computed on the way
    are computed on demand; each equals a fresh constraint's after the same tokens."""
    text = hf_tokenizer.encode('{"language":"french","verdict":false}')
    fresh_masks = []
    fresh = constraint(vocabulary)
    for token in text:
        fresh_masks.append(fresh.allowed().copy())
        fresh.advance(token)
    c = constraint(vocabulary)
    for token in text:
        c.allowed()
        c.advance(token)
    computed = []
    library_allowed = Constraint.library_allowed
    monkeypatch.setattr(Constraint, "library_allowed", lambda self: computed.append(1) or library_allowed(self))
    for got, want in zip(c.masks(len(text)), fresh_masks):
        np.testing.assert_array_equal(got, want)
    c.rollback(5)
    np.testing.assert_array_equal(c.allowed(), fresh_masks[len(text) - 5])
    assert computed == []
    assert c.masks(0) == []

    lazy = constraint(vocabulary)
    for token in text[:10]:
        lazy.advance(token)  # no mask asked for on the way
    for got, want in zip(lazy.masks(4), fresh_masks[6:10]):
        np.testing.assert_array_equal(got, want)
    assert lazy.tokens == text[:10] and len(computed) == 4
    with pytest.raises(ValueError):
        lazy.masks(11)


def test_rollback_returns_to_the_state_a_fresh_constraint_reaches(vocabulary, hf_tokenizer):
    text = hf_tokenizer.encode('{"language":"french","verdict":false}')
    c = constraint(vocabulary)
    for token in text:
        c.advance(token)
    assert c.is_finished() and c.tokens == text
    for keep in (len(text) - 1, 20, 12, 3, 0):
        c.rollback(len(c.tokens) - keep)
        fresh = constraint(vocabulary)
        for token in text[:keep]:
            fresh.advance(token)
        assert c.tokens == fresh.tokens == text[:keep]
        np.testing.assert_array_equal(c.allowed(), fresh.allowed())
        assert c.forced_tokens() == fresh.forced_tokens()
        assert c.is_finished() == fresh.is_finished() is False
    with pytest.raises(ValueError):
        c.rollback(1)  # nothing left to take back


def test_a_disallowed_token_raises_and_leaves_the_state_as_it_was(vocabulary, hf_tokenizer):
    c = constraint(vocabulary)
    c.advance(hf_tokenizer.convert_tokens_to_ids("{"))
    before = c.allowed().copy()
    for bad in (hf_tokenizer.convert_tokens_to_ids("}"), EOS, 350):  # a wrong token, the end, a padded row
        with pytest.raises(ConstraintViolation):
            c.advance(bad)
    np.testing.assert_array_equal(c.allowed(), before)
    c.advance(hf_tokenizer.convert_tokens_to_ids('"'))  # still usable
    assert len(c.tokens) == 2


def test_a_finished_grammar_allows_only_the_end_tokens(vocabulary, hf_tokenizer):
    c = constraint(vocabulary)
    for token in hf_tokenizer.encode('{"language":"python","verdict":true'):
        c.advance(token)
    assert not c.is_finished()
    assert EOS not in allowed_ids(c)
    c.advance(hf_tokenizer.convert_tokens_to_ids("}"))
    assert c.is_finished()
    assert allowed_ids(c) == [EOS]
    c.advance(EOS)
    assert c.is_finished() and allowed_ids(c) == [EOS] and c.forced_tokens() == []
    c.rollback(1)  # a drafted end token taken back: back to the closed object, not before its brace
    assert c.is_finished() and allowed_ids(c) == [EOS]
    c.rollback(1)
    assert not c.is_finished() and allowed_ids(c) == [hf_tokenizer.convert_tokens_to_ids("}")]


def test_json_object_allows_any_object_and_only_objects(vocabulary, hf_tokenizer):
    c = constraint(vocabulary, {"type": "json_object"})
    assert hf_tokenizer.decode(allowed_ids(c)) == "{"
    for token in hf_tokenizer.encode('{"a": [1, {"b": null}], "c": "x"}'):
        c.advance(token)
    assert c.is_finished()


def test_flexible_whitespace_is_the_default(vocabulary, hf_tokenizer):
    schema_only = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    c = constraint(vocabulary, schema_only)
    c.advance(hf_tokenizer.convert_tokens_to_ids("{"))
    assert hf_tokenizer.convert_tokens_to_ids("Ġ") in allowed_ids(c)  # a space may follow the brace
    compact = constraint(vocabulary)
    compact.advance(hf_tokenizer.convert_tokens_to_ids("{"))
    assert allowed_ids(compact) == [hf_tokenizer.convert_tokens_to_ids('"')]


@pytest.mark.parametrize(
    "response_format, fragment",
    [
        ("json", "response_format must be an object"),
        ({"type": "yaml"}, "response_format type 'yaml'"),
        ({"type": "json_schema"}, "json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": "not a schema"}}, "json_schema.schema"),
        ({"type": "json_object", "whitespace": "tabs"}, "whitespace"),
        (
            {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            },
            "nonsense",
        ),
    ],
)
def test_bad_response_formats_are_one_line_errors(vocabulary, response_format, fragment):
    with pytest.raises(EdgeSpecError) as info:
        Constraint(grammar_for(response_format), vocabulary)
    message = str(info.value)
    assert fragment in message and "\n" not in message, message


def test_text_response_format_has_no_constraint():
    assert grammar_for({"type": "text"}) is None
    assert grammar_for(None) is None


def test_mask_logits_sends_disallowed_tokens_to_minus_infinity():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    allowed = rng.random((3, 50)) < 0.2
    masked = mask_logits(logits, allowed)
    assert masked.dtype == logits.dtype and np.all(masked[~allowed] == -np.inf)
    np.testing.assert_array_equal(masked[allowed], logits[allowed])
    for row, keep, raw in zip(masked, allowed, logits):
        assert np.argmax(row) == np.flatnonzero(keep)[np.argmax(raw[keep])]
        probs = logits_to_probs(row, SamplingParams(temperature=0.8, top_k=3))
        assert probs[~keep].sum() == 0.0 and probs.sum() == pytest.approx(1.0)
    np.testing.assert_array_equal(mask_logits(logits, None), logits)


def test_regex_and_lark_formats(vocabulary, hf_tokenizer):
    c = constraint(vocabulary, {"type": "regex", "regex": "(yes|no)"})
    assert EOS not in allowed_ids(c)
    for token in hf_tokenizer.encode("no"):
        c.advance(token)
    assert c.is_finished() and allowed_ids(c) == [EOS]
    lark = constraint(vocabulary, {"type": "lark", "lark": 'start: "fox" | "dog"'})
    for token in hf_tokenizer.encode("dog"):
        lark.advance(token)
    assert lark.is_finished()
    with pytest.raises(ConstraintViolation):
        constraint(vocabulary, {"type": "regex", "regex": "(yes|no)"}).advance(hf_tokenizer.convert_tokens_to_ids("{"))


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "regex", "regex": r"<\|im_start\|>x"},
        {"type": "regex", "regex": r"(<\|im_end\|>|ab)+"},
        {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}},
    ],
)
def test_every_allowed_token_can_be_consumed(vocabulary, response_format):
    """What ``allowed`` lets through, ``advance`` must take: the grammar engine reads added tokens as special,
    so one whose text a grammar spells can pass its mask and then be refused (a failure mid-answer)."""
    try:
        c = constraint(vocabulary, response_format)
        ids = allowed_ids(c)
    except EdgeSpecError:
        return  # a grammar only an added token could start is refused up front: no failure mid-answer
    for token in ids:
        probe = c.copy()
        probe.advance(token)  # raises ConstraintViolation where allowed() and advance() disagree
    assert ids
