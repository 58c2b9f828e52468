"""SpecVocab: scorer construction, candidate recall, the runtime head, adding heads to a bundle."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.export.bundle.build import ExportOptions, add_draft_heads
from edge_spec.export.heads.specvocab import fit_scorer, quantize_rows_int8, recall_at_k, top_candidates
from edge_spec.manifest import read_manifest, verify_files
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.propose.suffix_cache import SuffixCache
from tests import tiny_models


def test_full_rank_structure_is_recovered_exactly():
    rng = np.random.default_rng(0)
    head = rng.standard_normal((500, 6)) @ rng.standard_normal((6, 40))  # rank 6
    scorer = fit_scorer(head, 6)
    h = rng.standard_normal((10, 40)).astype(np.float32)
    np.testing.assert_allclose(scorer.scores(h), h @ head.T.astype(np.float32), rtol=1e-3, atol=1e-3)


def test_data_aware_fit_beats_plain_svd_on_the_states_it_was_fitted_to():
    rng = np.random.default_rng(1)
    head = rng.standard_normal((800, 32)).astype(np.float32)
    # hidden states that live mostly in a few directions the plain SVD does not favour
    basis = np.linalg.qr(rng.standard_normal((32, 32)))[0][:, :4]
    states = (rng.standard_normal((2000, 4)) * 5) @ basis.T + 0.05 * rng.standard_normal((2000, 32))
    states = states.astype(np.float32)
    err = {}
    for name, fitted in (("svd", fit_scorer(head, 4)), ("data", fit_scorer(head, 4, states))):
        err[name] = float(np.mean((fitted.scores(states) - states @ head.T) ** 2))
    assert err["data"] < 0.1 * err["svd"], err


def test_rank_is_checked():
    with pytest.raises(EdgeSpecError, match="--rank"):
        fit_scorer(np.ones((10, 4)), 5)


def test_top_candidates_and_recall_with_always_kept_ids():
    scores = np.array([0.1, 5.0, 3.0, -1.0, 4.0])
    assert set(top_candidates(scores, 2).tolist()) == {1, 4}
    head = np.eye(5, dtype=np.float32)
    scorer = fit_scorer(head, 5)
    hidden = (10 * np.eye(5) - 0.1 * np.arange(5)).astype(np.float32)  # no ties among the runners-up
    # state i scores token i highest; ask whether token (i + 1) % 5 is in the top-1 (never) or
    # in the top-1 plus the always-kept token 3 (only for i = 2)
    wanted = (np.arange(5) + 1) % 5
    assert recall_at_k(scorer, hidden, wanted, [1])[1] == 0.0
    assert recall_at_k(scorer, hidden, wanted, [1], always=np.array([3]))[1] == pytest.approx(0.2)


def test_recall_over_a_universe_maps_rows_to_target_ids():
    head = np.eye(4, dtype=np.float32)
    scorer = fit_scorer(head, 4)  # rows 0..3 stand for target ids 10, 20, 30, 40
    universe = np.array([10, 20, 30, 40])
    hidden = (10 * np.eye(4) - 0.1 * np.arange(4)).astype(np.float32)
    assert recall_at_k(scorer, hidden, universe, [1], universe=universe)[1] == 1.0
    assert recall_at_k(scorer, hidden, universe[::-1], [1], universe=universe)[1] == 0.0
    # an always-kept id outside the universe still counts as a candidate
    assert recall_at_k(scorer, hidden, np.full(4, 99), [1], always=np.array([99]), universe=universe)[1] == 1.0


def test_specvocab_head_over_a_universe_picks_only_universe_rows(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="specvocab-r16-k48-of160")
    head = engine.bundle.drafter.head
    assert head.universe is not None and len(head.universe) == 160
    for seed in range(5):
        hidden = np.random.default_rng(seed).standard_normal(64).astype(np.float32)
        logits, ids = head(hidden)
        assert len(set(ids.tolist())) == len(ids) == 48 + head.always.size
        assert set(ids.tolist()) <= set(head.universe.tolist()) | set(head.always.tolist())


def test_int8_rows_roundtrip():
    w = np.random.default_rng(2).standard_normal((7, 33)).astype(np.float32)
    codes, scales = quantize_rows_int8(w)
    assert codes.dtype == np.int8
    np.testing.assert_allclose(codes * scales[:, None], w, atol=np.abs(w).max() / 127)


def test_calibration_recall_beats_a_random_subset(int4_bundle):
    heads = read_manifest(int4_bundle)["draft"]["heads"]
    head = heads["specvocab-r16-k48"]
    random_subset = head["size"] / 384  # a random subset of the same size covers this share on average
    assert head["calibration_recall"] > 2 * random_subset, head["calibration_recall"]
    united = heads["trim32+specvocab-r16-k48"]
    assert united["size"] == 48 + 32
    assert united["calibration_recall"] >= head["calibration_recall"]


def test_specvocab_head_gives_exact_logits_on_its_candidates(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="trim32+specvocab-r16-k48")
    head = engine.bundle.drafter.head
    hidden = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    logits, ids = head(hidden)
    assert len(ids) == len(set(ids.tolist())) == 48 + head.always.size
    assert set(head.always.tolist()) <= set(ids.tolist())
    reference = (head.rows.astype(np.float32) @ hidden) * head.scales
    np.testing.assert_allclose(logits, reference[ids], rtol=1e-5, atol=1e-5)


class _FilteredHead:
    """The real SpecVocab head with some target ids removed from every candidate set."""

    def __init__(self, head, banned: set[int]) -> None:
        self.head = head
        self.banned = np.array(sorted(banned), np.int64)
        self.vocab_ids = None

    @property
    def seconds(self) -> float:
        return self.head.seconds

    def __call__(self, hidden):
        logits, ids = self.head(hidden)
        kept = ~np.isin(ids, self.banned)
        return logits[kept], ids[kept]


def _spec_and_target(engine, prompt="def is_prime", tokens=30):
    """The spec answer first: the target's, once given, would be drafted from the suffix cache."""
    spec = engine.complete(prompt, max_new_tokens=tokens)
    target = engine.complete(prompt, max_new_tokens=tokens, mode="ar")
    return spec, target


def test_spec_mode_reports_candidate_recall(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="specvocab-r16-k48")
    spec, target = _spec_and_target(engine)
    assert spec.token_ids == target.token_ids
    extra = spec.stats.spec
    assert 0.0 <= extra.candidate_recall <= 1.0
    # every accepted draft token was drawn from its candidate set: at least that share of positions hit
    assert extra.candidate_recall >= extra.acceptance_rate
    assert 0.0 < extra.head_seconds < extra.draft_seconds


def test_candidate_recall_is_one_when_every_id_is_a_candidate(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="specvocab-r16-k48")
    head = engine.bundle.drafter.head
    head.candidates = len(head.scales)  # the scorer ranks all 384 ids: every one is a candidate
    spec, target = _spec_and_target(engine)
    assert spec.token_ids == target.token_ids
    assert spec.stats.spec.candidate_recall == 1.0


def test_candidate_recall_is_zero_when_the_target_tokens_are_never_candidates(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec", draft_head="specvocab-r16-k48")
    target = engine.complete("def is_prime", max_new_tokens=30, mode="ar")
    drafter = engine.bundle.drafter
    drafter.head = _FilteredHead(drafter.head, set(target.token_ids))
    engine.bundle.suffix_cache = SuffixCache()  # forget the answer just given: only the drafter drafts
    spec = engine.complete("def is_prime", max_new_tokens=30)
    assert spec.token_ids == target.token_ids  # a drafter that never hits still gives the target's tokens
    assert spec.stats.spec.candidate_recall == 0.0
    assert spec.stats.spec.acceptance_rate == 0.0


def _add_heads_to_a_copy(int4_bundle, tmp_path, tiny_pair, options):
    """Copy the shared bundle, add heads for its own drafter, return (copy, manifest)."""
    bundle = tmp_path / "copy"
    shutil.copytree(int4_bundle, bundle)
    tokenizer, _, draft = tiny_pair
    drafter = {"tiny-draft": tiny_models.loaded("tiny-draft", draft, tokenizer)}
    return bundle, add_draft_heads(bundle, options, "tiny-draft", loader=drafter.__getitem__)


def test_add_heads_to_an_existing_bundle(int4_bundle, tmp_path, tiny_pair):
    options = ExportOptions(draft_vocab="specvocab", rank=(8,), candidates=(32,), scorer="svd")
    bundle, manifest = _add_heads_to_a_copy(int4_bundle, tmp_path, tiny_pair, options)
    verify_files(bundle, manifest, full_hash=True)
    assert "specvocab-r8-k32" in manifest["draft"]["heads"] and "trim-64" in manifest["draft"]["heads"]
    assert json.loads((bundle / "manifest.json").read_text())["draft"]["default_head"] == "specvocab-r8-k32"
    engine = Engine.from_bundle(bundle, threads=1, mode="spec", draft_head="specvocab-r8-k32")
    assert (
        engine.complete("The quick", max_new_tokens=20).token_ids
        == engine.complete("The quick", max_new_tokens=20, mode="ar").token_ids
    )


def test_add_heads_refuses_another_drafter(int4_bundle, tmp_path, tiny_pair):
    bundle = tmp_path / "copy"
    shutil.copytree(int4_bundle, bundle)
    tokenizer = tiny_pair[0]
    other = tiny_models.make_qwen2(seed=5, hidden=32)
    loader = {"other": tiny_models.loaded("other", other, tokenizer)}.__getitem__
    with pytest.raises(EdgeSpecError, match="does not match"):
        add_draft_heads(bundle, ExportOptions(draft_vocab="specvocab"), "other", loader=loader)


def test_bad_draft_vocab_is_refused():
    with pytest.raises(EdgeSpecError, match="--draft-vocab"):
        ExportOptions(draft_vocab="trim,magic").check()


def test_add_heads_drops_heads_whose_scorer_was_rebuilt(int4_bundle, tmp_path, tiny_pair):
    # rank 16 again, with other candidates: scorer_r16.onnx is rewritten, so the old k48 heads on it go
    options = ExportOptions(draft_vocab="specvocab", rank=(16,), candidates=(32,), scorer="svd")
    bundle, manifest = _add_heads_to_a_copy(int4_bundle, tmp_path, tiny_pair, options)
    heads = manifest["draft"]["heads"]
    assert "specvocab-r16-k32" in heads and "specvocab-r16-k48" not in heads
    assert "specvocab-r16-k48-of160" in heads  # its scorer (universe 160) was not touched
    verify_files(bundle, read_manifest(bundle), full_hash=True)
