"""Multi-draft (tree) decoding on tiny models: tree pass, KV compaction, greedy identity, exact sampling."""

from __future__ import annotations

import numpy as np
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.manifest import read_manifest
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import TreeConfig
from edge_spec.runtime.loops.tree import check_tree
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.model.draft_tree import DraftTree
from edge_spec.runtime.verify.sampling import SamplingParams
from tests.helpers import PROMPTS, chain, chi_square_same_distribution, run


def target_decoder(bundle) -> Decoder:
    return Decoder(bundle / read_manifest(bundle)["target"]["onnx"], threads=1, capacity=64)


def test_tree_layout():
    tree = DraftTree(7, ((1, 2), (3,), (4, 5)))
    assert tree.tokens == [7, 1, 2, 3, 4, 5]
    assert tree.nodes(2) == [4, 5]
    assert tree.positions(10).tolist() == [10, 11, 12, 11, 11, 12]
    bias = tree.attention_bias(2)
    visible = np.isfinite(bias[:, 2:])
    # node 5 (branch 3, depth 2) sees the root, node 4 and itself, never branches 1 or 2; later nodes
    # of its own branch are left to GQA's causal mask
    assert visible[5].tolist() == [True, False, False, False, True, True]
    assert visible[3].tolist() == [True, False, False, True, False, False]
    assert visible[1].tolist() == [True, True, True, False, False, False]
    assert np.all(bias[:, :2] == 0)


def test_tree_pass_equals_separate_chains_and_keep_path_compacts(fp32_bundle):
    """Each branch's rows in one tree pass equal a plain pass over that branch alone; after
    keep_path the cache continues exactly as a fresh forward over the accepted path."""
    prompt = [3, 17, 42, 8, 99, 5]
    branches = ((11, 12, 13), (21, 22, 23), (31, 32))
    dec = target_decoder(fp32_bundle)
    dec.forward(prompt)
    tree = DraftTree(7, branches)
    rows = dec.forward(tree.tokens, tree.size, tree=tree)["logits"]
    for j, branch in enumerate(branches):
        ref = target_decoder(fp32_bundle)
        ref.forward(prompt)
        chain = ref.forward([7, *branch], len(branch) + 1)["logits"]
        np.testing.assert_allclose(rows[[0] + tree.nodes(j)], chain, atol=1e-4)
    dec.keep_path(len(prompt), [0] + tree.nodes(1)[:2])  # root, 21, 22
    assert dec.tokens == prompt + [7, 21, 22]
    after = dec.forward([50, 51], 2)["logits"]
    fresh = target_decoder(fp32_bundle)
    fresh.forward(prompt)
    np.testing.assert_allclose(after, fresh.forward([7, 21, 22, 50, 51], 2)["logits"], atol=1e-4)
    with pytest.raises(ValueError, match="cannot keep"):
        dec.keep_path(len(prompt), [0, 9])


@pytest.fixture(scope="module", params=["full", "trim-64", "specvocab-r16-k48"])
def head_engine(request, int4_bundle):
    return Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head=request.param)


@pytest.mark.parametrize("drafts,gamma", [(2, 1), (2, 3), (3, 2), (4, 4)])
def test_greedy_multidraft_equals_autoregressive(head_engine, drafts, gamma):
    engine = head_engine
    first_multi = first_single = 0
    for prompt in PROMPTS:
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, SamplingParams(), 40, None)
        got, stats = run(engine, ids, SamplingParams(), 40, TreeConfig(gamma=gamma, drafts=drafts))
        assert got == reference, f"head={engine.bundle.draft_head} k={drafts} γ={gamma} prompt={prompt!r}"
        assert engine.bundle.target.length == len(ids) + len(got) - 1
        _, single = run(engine, ids, SamplingParams(), 40, chain(gamma))
        first_multi += stats.first_accepted
        first_single += single.first_accepted
    # the extra branches were used: top-k branching accepts the first position more often
    assert first_multi > first_single


@pytest.mark.slow
@pytest.mark.parametrize("scheme,drafts", [("rrs", 2), ("rrs-wor", 3), ("spechub", 2)])
def test_sampled_multidraft_matches_target_distribution(int4_bundle, scheme, drafts):
    """The joint law of the first 3 tokens (2 and 3 go through tree verification) equals target-only
    sampling (two-sample chi-square)."""
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim-64")
    params = SamplingParams(temperature=1.0)
    ids = engine.bundle.tokenizer.encode("The quick")
    n = 1500
    ar = [tuple(run(engine, ids, params, 3, None, seed=s)[0]) for s in range(n)]
    spec = TreeConfig(gamma=2, drafts=drafts, verifier=scheme)
    multi = [tuple(run(engine, ids, params, 3, spec, seed=10**6 + s)[0]) for s in range(n)]
    assert chi_square_same_distribution(ar, multi) > 1e-3


def test_engine_multidraft_mode_and_errors(int4_bundle):
    spec = TreeConfig(gamma=2, drafts=2, verifier="spechub")
    engine = Engine.from_bundle(int4_bundle, threads=1, config=spec)
    got = engine.complete("def is_prime", max_new_tokens=20)
    ar = engine.complete("def is_prime", max_new_tokens=20, mode="ar")
    assert got.token_ids == ar.token_ids
    # the rate is the share of the target calls with drafts that accepted their first position, i.e.
    # accepted anything (a round with no room left drafts nothing); the second branch makes it higher
    # than one chain's
    summary = got.stats.spec
    accepted, drafted = summary.accepted_lengths, summary.drafted_lengths
    assert len(accepted) == len(drafted) == summary.target_calls and any(accepted)
    with_drafts = [a for a, d in zip(accepted, drafted) if d]
    assert summary.first_token_acceptance == pytest.approx(sum(a > 0 for a in with_drafts) / len(with_drafts))
    single = Engine.from_bundle(int4_bundle, threads=1, config=chain(2))
    one_chain = single.complete("def is_prime", max_new_tokens=20)
    assert got.stats.spec.first_token_acceptance > one_chain.stats.spec.first_token_acceptance
    three = Engine.from_bundle(int4_bundle, threads=1, config=TreeConfig(drafts=3, verifier="spechub"))
    assert three.complete("def is_prime", max_new_tokens=8).token_ids == ar.token_ids[:8]  # greedy: top-3
    with pytest.raises(EdgeSpecError, match="exactly 2 drafts"):
        three.complete("def is_prime", max_new_tokens=8, temperature=0.7)
    with pytest.raises(EdgeSpecError, match="unknown multi-draft verifier"):
        Engine.from_bundle(int4_bundle, threads=1, config=TreeConfig(drafts=2, verifier="beam"))
    drafter_body = engine.bundle.drafter.body  # a graph exported without tree inputs
    with pytest.raises(EdgeSpecError, match="no tree-attention inputs"):
        check_tree(drafter_body, spec)
