"""Token log-probabilities: each emitted token's log-probability and its top alternatives under the
target's own distribution at that position (the log-softmax of the raw logits, before temperature, top-k,
top-p or a constraint's mask).

Asking for them must never change the answer; in exact greedy decoding the speculative loop's rows are
the rows target-only decoding computes, so the two report the same numbers; and every reported number is
what a fresh target pass over the prompt and the answer so far gives -- not the drafter's.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.manifest import read_manifest
from edge_spec.runtime import logprobs as logprobs_module
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import TreeConfig, loop_config
from edge_spec.runtime.model.decoder import Decoder

PROMPTS = ["hello world", "the cat sat on the mat and the cat sat on the mat and the"]
TOL = 1e-4


@pytest.fixture(scope="module")
def spec(int4_bundle):
    return Engine.from_bundle(int4_bundle, mode="spec", threads=1)


@pytest.fixture(scope="module")
def drafting(int4_bundle):
    """The drafter model drafts every round, so most emitted tokens come out of multi-row verify passes
    (the adaptive schedule soon stops asking the tiny drafter); its full head gives the drafter's own
    distribution over the whole vocabulary (the negative control)."""
    return Engine.from_bundle(
        int4_bundle, threads=1, draft_head="full", config=loop_config("spec", gamma=4, schedule="fixed")
    )


@pytest.fixture(scope="module")
def ar(int4_bundle):
    return Engine.from_bundle(int4_bundle, mode="ar", threads=1)


@pytest.fixture(scope="module")
def fresh_target(int4_bundle):
    """The bundle's target graph in a decoder of its own: the reference the engine's numbers must match."""
    manifest = read_manifest(int4_bundle)
    return Decoder(int4_bundle / manifest["target"]["onnx"], threads=1, capacity=manifest["context_length"])


def run(engine, prompt, top=None, **kwargs):
    """(chunks, token ids, the engine's entries, the entries handed out per chunk)."""
    seen = []
    chunks = list(engine.generate(prompt, logprobs=top, on_logprobs=seen.append if top is not None else None, **kwargs))
    return chunks, list(engine.last_token_ids), list(engine.last_logprobs), seen


def log_softmax(rows: np.ndarray) -> np.ndarray:
    x = np.asarray(rows, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def reference(decoder: Decoder, prompt_ids: list[int], ids: list[int], one_row: bool = False) -> np.ndarray:
    """log_softmax of a fresh target pass over prompt + answer: row i is the distribution of ids[i].

    ``one_row``: the answer fed one token per pass after the prompt, as target-only decoding that is not
    exact feeds it.  Where the int4 matmuls have a one-row path (AVX2 CPUs), such a pass rounds its
    activations a last bit away from a multi-row pass's, and where that bit moves a value across an int8
    rounding step of the next matmul's quantised input (accuracy level 4), the log-probability moves by
    a few hundredths: at about one position in twenty-five of the tiny target, whichever attention op."""
    decoder.reset()
    if not one_row:
        return log_softmax(decoder.prefill(prompt_ids + ids[:-1], num_logits=len(ids))["logits"])
    rows = [decoder.prefill(prompt_ids)["logits"]] + [decoder.forward([t])["logits"] for t in ids[:-1]]
    return log_softmax(np.concatenate(rows))


# -- the answer does not change ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ar", "spec"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=7, sampler="coupled")])
def test_logprobs_change_no_token(spec, mode, sampling):
    for prompt in PROMPTS:
        plain, plain_ids, plain_entries, _ = run(spec, prompt, mode=mode, max_new_tokens=40, **sampling)
        stats = spec.last_stats
        chunks, ids, entries, seen = run(spec, prompt, top=5, mode=mode, max_new_tokens=40, **sampling)
        assert ids == plain_ids and chunks == plain
        assert spec.last_stats.stop_reason == stats.stop_reason
        assert plain_entries == []  # not asked for: none kept
        assert [e.token_id for e in entries] == ids
        handed = [e for chunk in seen for e in chunk]  # per chunk, or once more for tokens with no text
        assert len(chunks) <= len(seen) <= len(chunks) + 1
        assert [(e.token_id, e.logprob, e.top) for e in handed] == [(e.token_id, e.logprob, e.top) for e in entries]


def test_not_asking_computes_nothing(spec, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a log-softmax was computed though no log-probabilities were asked for")

    monkeypatch.setattr(logprobs_module, "token_logprob", refuse)
    for mode in ("ar", "spec"):
        assert "".join(spec.generate(PROMPTS[0], mode=mode, max_new_tokens=12))
    with pytest.raises(AssertionError, match="log-softmax"):  # the control: asking does reach it
        "".join(spec.generate(PROMPTS[0], mode="ar", max_new_tokens=2, logprobs=0))


@pytest.mark.parametrize("top", [-1, 21, 2.5, True])
def test_out_of_range_top_is_refused(spec, top):
    with pytest.raises(EdgeSpecError, match="logprobs"):
        "".join(spec.generate(PROMPTS[0], max_new_tokens=2, logprobs=top))


# -- the numbers ---------------------------------------------------------------------------------------


def test_spec_logprobs_equal_ar_exact(spec, drafting, ar):
    drafted = 0
    for engine in (spec, drafting):
        for prompt in PROMPTS + ["def is_prime(n):"]:
            _, ids, entries, _ = run(engine, prompt, top=5, max_new_tokens=48)
            drafted += sum(engine.last_stats.spec.accepted_lengths)
            _, ar_ids, ar_entries, _ = run(ar, prompt, top=5, max_new_tokens=48, exact=True)
            assert ids == ar_ids
            for got, want in zip(entries, ar_entries, strict=True):
                assert abs(got.logprob - want.logprob) <= TOL
                assert len(got.top) == len(want.top) == 5
                for (gid, glp), (wid, wlp) in zip(got.top, want.top):
                    assert abs(glp - wlp) <= TOL
                    assert gid == wid or abs(glp - wlp) <= 1e-6  # ties aside
    assert drafted > 0  # accepted drafts' numbers came from verify rows, not one-token passes


@pytest.mark.parametrize("mode", ["ar", "spec"])
def test_each_logprob_is_the_target_s_own(spec, drafting, fresh_target, mode):
    engine = drafting if mode == "spec" else spec
    for prompt in PROMPTS:
        _, ids, entries, _ = run(engine, prompt, top=20, mode=mode, max_new_tokens=40)
        want = reference(fresh_target, engine.prompt_ids(prompt), ids, one_row=mode == "ar")
        got = np.array([e.logprob for e in entries])
        assert np.abs(got - want[np.arange(len(ids)), ids]).max() <= TOL
        for i, entry in enumerate(entries):
            order = np.argsort(-want[i], kind="stable")[:20]
            assert [t for t, _ in entry.top] == order.tolist() or np.allclose(
                [lp for _, lp in entry.top], want[i][order], atol=1e-6
            )  # ties aside
            assert np.abs(np.array([lp for _, lp in entry.top]) - want[i][order]).max() <= TOL

        # negative control: the drafter's distribution at the same positions is not what was reported
        drafter = drafting.bundle.active_drafter(drafting.config)  # its full head
        prompt_ids = engine.prompt_ids(prompt)
        theirs = []
        for i, token in enumerate(ids):
            logits, rows = drafter.next_logits(prompt_ids + ids[:i])
            assert rows is None  # the full head: every token has its row
            theirs.append(log_softmax(logits)[token])
        assert np.abs(np.array(theirs) - got).max() > 100 * TOL


def test_the_reported_distribution_is_the_raw_one(spec, fresh_target):
    """Sampling settings change which tokens are drawn, not what is reported: the model's distribution."""
    prompt = PROMPTS[1]
    settings = dict(temperature=0.5, top_k=3, top_p=0.9, seed=3, sampler="coupled")
    for mode in ("ar", "spec"):
        _, ids, entries, _ = run(spec, prompt, top=5, mode=mode, max_new_tokens=32, **settings)
        decoder_rows = reference(fresh_target, spec.prompt_ids(prompt), ids, one_row=mode == "ar")
        got = np.array([e.logprob for e in entries])
        assert np.abs(got - decoder_rows[np.arange(len(ids)), ids]).max() <= TOL
        # negative control: the tempered distribution the tokens were drawn from differs
        fresh_target.reset()
        raw = fresh_target.prefill(spec.prompt_ids(prompt) + ids[:-1], num_logits=len(ids))["logits"]
        tempered = log_softmax(raw / 0.5)[np.arange(len(ids)), ids]
        assert np.abs(got - tempered).max() > 100 * TOL


def test_under_a_constraint_the_raw_distribution_is_reported(spec, fresh_target):
    prompt = "answer in json:"
    response_format = {"type": "json_object"}
    for mode in ("ar", "spec"):
        _, ids, entries, _ = run(spec, prompt, top=20, mode=mode, max_new_tokens=24, response_format=response_format)
        want = reference(fresh_target, spec.prompt_ids(prompt), ids, one_row=mode == "ar")
        got = np.array([e.logprob for e in entries])
        assert np.abs(got - want[np.arange(len(ids)), ids]).max() <= TOL
        # negative control: the distribution renormalised over what the grammar allowed is not what was reported
        constraint = spec.constraint_for(response_format)
        masked = []
        for i, token in enumerate(ids):
            allowed = constraint.allowed()
            row = np.where(allowed, want[i], -np.inf)
            masked.append(row[token] - np.log(np.exp(row - row.max()).sum()) - row.max())
            constraint.advance(token)
        assert np.abs(got - np.array(masked)).max() > 100 * TOL


def test_top_logprobs_are_sorted_and_bound_the_token_s_own(spec):
    for mode in ("ar", "spec"):
        for top in (0, 1, 7, 20):
            _, _, entries, _ = run(
                spec, PROMPTS[0], top=top, mode=mode, max_new_tokens=16, temperature=1.0, seed=11, sampler="coupled"
            )
            for entry in entries:
                assert len(entry.top) == top
                values = [lp for _, lp in entry.top]
                assert values == sorted(values, reverse=True)
                assert len({t for t, _ in entry.top}) == top
                assert entry.logprob <= 0.0
                if top:
                    assert entry.logprob <= values[0]
                    if entry.token_id in dict(entry.top):
                        assert dict(entry.top)[entry.token_id] == entry.logprob
            if top == 20:  # sampled at temperature 1: some drawn token is not the most likely one
                assert any(e.logprob < e.top[0][1] for e in entries)


# -- the other speculative loops -----------------------------------------------------------------------


@pytest.mark.parametrize("config", [TreeConfig(drafts=2), loop_config("ssd")], ids=["tree", "ssd"])
def test_tree_and_ssd_report_the_target_s_rows(int4_bundle, fresh_target, config):
    engine = Engine.from_bundle(int4_bundle, threads=1, draft_threads=1, config=config)
    prompt = PROMPTS[1]
    _, plain_ids, _, _ = run(engine, prompt, max_new_tokens=32)
    _, ids, entries, _ = run(engine, prompt, top=3, max_new_tokens=32)
    assert ids == plain_ids
    assert sum(engine.last_stats.spec.accepted_lengths) > 0
    want = reference(fresh_target, engine.prompt_ids(prompt), ids)
    got = np.array([e.logprob for e in entries])
    # tree passes attend through a mask and may round differently from one straight pass
    assert np.abs(got - want[np.arange(len(ids)), ids]).max() <= 1e-3
    shifted = want[np.arange(1, len(ids)), ids[:-1]]  # negative control: each token read one row late
    assert np.abs(got[:-1] - shifted).max() > 1e-2


# -- text chunks --------------------------------------------------------------------------------------


def test_each_chunk_carries_the_tokens_whose_text_it_starts(spec):
    chunks, ids, _, seen = run(spec, PROMPTS[1], top=2, mode="spec", max_new_tokens=40)
    text = "".join(chunks)
    handed = [e for chunk in seen for e in chunk]
    assert [e.token_id for e in handed] == ids  # no stop string: every token, once, in order
    offsets = [e.text_offset for e in handed]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    start = 0
    for chunk, chunk_entries in zip(chunks, seen):  # a chunk's tokens begin inside it
        assert all(start <= e.text_offset < start + len(chunk) for e in chunk_entries)
        start += len(chunk)
    for i, entry in enumerate(handed):  # the text before a token's offset is the text of the tokens before it
        before = spec.bundle.tokenizer.decode(ids[:i])
        if "\ufffd" not in before:  # (unless a character is cut in two there)
            assert before == text[: entry.text_offset]

    # a stop string: the tokens whose text is dropped with it are not reported
    decode = spec.bundle.tokenizer.decode
    k = next(
        k
        for k in range(len(ids) // 2, len(ids) - 2)
        if decode(ids[k : k + 2]).strip()
        and decode(ids[: k + 2]) == decode(ids[:k]) + decode(ids[k : k + 2])
        and text.find(decode(ids[k : k + 2])) == len(decode(ids[:k]))
    )
    cut_chunks, cut_ids, cut_entries, cut_seen = run(
        spec, PROMPTS[1], top=2, mode="spec", max_new_tokens=40, stop=[decode(ids[k : k + 2])]
    )
    assert spec.last_stats.stop_reason == "stop" and "".join(cut_chunks) == decode(ids[:k])
    assert cut_ids == ids[: k + 2] and len(cut_entries) == k + 2
    assert [e.token_id for chunk in cut_seen for e in chunk] == ids[:k]  # the stop string's two are not
