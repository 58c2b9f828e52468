"""Multi-draft speculative decoding: k branches from the pending token, one tree-shaped target pass.

Read it like :mod:`speculative`, of which it is the tree-shaped twin:

* Draft: the drafter catches up on ``committed`` and computes its distribution
  ``q`` at the root (the position after the pending token ``x``).  From it come
  k first tokens -- top-k when greedy; otherwise drawn by the scheme whose
  verifier follows (i.i.d. for RRS, without replacement for RRS-w/o, the
  hub pair for SpecHub, see :mod:`multidraft`).  Each distinct first token
  starts a branch that the drafter extends into a chain of γ tokens
  (rewinding its cache to the root between branches).
* Verify: one target pass over the tree ``[x, branch 1, branch 2, ...]``
  (:mod:`draft_tree`: tree mask, positions by depth).  The root row decides
  which branch, if any, survives -- greedy: the branch whose first token is the
  target's argmax; sampled: the multi-draft verifier's ladder.  Along the
  surviving branch the ordinary chain verifier runs on that branch's rows.
* Roll back: the target keeps only the accepted path, compacted in place
  (:meth:`Decoder.keep_path`); the drafter re-syncs next round.

Exactness: at the root the emitted token follows p because the verifier
matches how the first tokens were drawn (proved per scheme in
:mod:`multidraft` and tested by enumeration); below it, a surviving branch
was drawn from q conditioned on its first token, so the chain verifier's usual
argument applies.  Greedy output is target-only greedy output, since every
emitted token is the target's argmax on its own prefix.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.decoder import Decoder
from edge_spec.runtime.draft_tree import DraftTree
from edge_spec.runtime.multidraft import DRAFT_SCHEMES, draw_first_tokens, ladder_for
from edge_spec.runtime.sampling import SamplingParams, logits_to_probs, sample, scatter_probs
from edge_spec.runtime.speculative import (DraftBlock, Drafter, SpecConfig, SpecStats, draft_chain, prefill_both,
                                          verify_drafts)


def check_multidraft(target: Decoder, config: SpecConfig, greedy: bool = False) -> None:
    """Refuse settings the tree loop cannot honour, in one clear line (greedy decoding branches on the
    drafter's top-k and ignores the sampling scheme)."""
    if config.drafts < 2:
        raise EdgeSpecError("multi-draft decoding needs at least 2 drafts")
    if config.scheme not in DRAFT_SCHEMES:
        raise EdgeSpecError(f"unknown multi-draft verifier {config.scheme!r}; choose one of: {', '.join(DRAFT_SCHEMES)}")
    if config.scheme == "spechub" and config.drafts != 2 and not greedy:
        raise EdgeSpecError("SpecHub verifies exactly 2 drafts per step (--drafts 2)")
    if not target.supports_tree:
        raise EdgeSpecError("this bundle's target graph has no tree-attention inputs; re-export it with this "
                            "edge-spec version to use multi-draft decoding")


def _root_drafts(logits: np.ndarray, ids: np.ndarray | None, params: SamplingParams, config: SpecConfig,
                 vocab_size: int, rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
    """The k first tokens (target ids) and, when sampling, the full-vocabulary q they came from."""
    if params.greedy:
        top = np.argsort(-logits, kind="stable")[:config.drafts]
        return [int(t) if ids is None else int(ids[t]) for t in top], None
    probs = logits_to_probs(logits, params)
    q = probs if ids is None else scatter_probs(probs, ids, vocab_size, validate=False)
    return draw_first_tokens(q, config.drafts, config.scheme, rng), q


def _verify_root(first_tokens: list[int], q_root: np.ndarray | None, root_row: np.ndarray,
                 params: SamplingParams, scheme: str, rng: np.random.Generator) -> tuple[int, bool]:
    """The token emitted at the root and whether it is one of the drafts."""
    if params.greedy:
        best = int(np.argmax(root_row))
        return best, best in first_tokens
    p = logits_to_probs(root_row, params)
    if not first_tokens:
        return sample(p, rng), False
    return ladder_for(scheme, first_tokens, q_root, p).sample(rng)


def generate_multidraft(
    target: Decoder,
    drafter: Drafter,
    prompt_ids: list[int],
    params: SamplingParams,
    rng: np.random.Generator,
    max_new_tokens: int,
    config: SpecConfig,
    stats: SpecStats | None = None,
) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` ids, distributed exactly as target-only decoding would produce them."""
    check_multidraft(target, config, params.greedy)
    stats = stats if stats is not None else SpecStats()
    draft = drafter.decoder
    committed = prefill_both(target, drafter, prompt_ids, params, rng)
    emitted = 1
    yield committed[-1]
    while emitted < max_new_tokens:
        # 1. draft: the root distribution once, then one chain per distinct first token.
        started = time.perf_counter()
        head_before = drafter.head.seconds
        base = len(committed) - 1
        depth = min(config.gamma, max_new_tokens - emitted - 1)
        if 1 + config.drafts * depth > target.capacity - base:
            depth = 0  # the tree would not fit in the context: a plain target step
        branches: list[DraftBlock] = []
        first_tokens: list[int] = []
        q_root = None
        steps = 0
        if depth > 0:
            logits, ids = drafter.step(draft.sync(committed))
            steps += 1
            first_tokens, q_root = _root_drafts(logits, ids, params, config, target.vocab_size, rng)
            for token in dict.fromkeys(first_tokens):  # a repeated first token shares its branch
                draft.rewind(len(committed))
                block = draft_chain(drafter, [token], params, rng, depth - 1, 0.0, target.vocab_size)
                block.tokens.insert(0, token)
                branches.append(block)
                steps += depth - 1
        tree = DraftTree(committed[-1], tuple(tuple(b.tokens) for b in branches))
        verify_started = time.perf_counter()
        stats.draft_seconds += verify_started - started
        stats.head_seconds += drafter.head.seconds - head_before

        # 2. verify: one pass over the whole tree; the root row picks the branch, its rows verify the chain.
        rows = target.forward(tree.tokens, tree.size, tree=tree)["logits"]
        token, hit = _verify_root(first_tokens, q_root, rows[0], params, config.scheme, rng)
        path, tokens = [0], [token]
        if hit:
            branch = [b.tokens[0] for b in branches].index(token)
            chain, nodes = branches[branch], tree.nodes(branch)
            result = verify_drafts(chain.tokens[1:], chain.q_rows, rows[nodes], params, rng)
            path += nodes[:1 + result.accepted]
            tokens = [token] + result.tokens
        stats.verify_seconds += time.perf_counter() - verify_started
        stats.accepted.append(len(path) - 1)
        stats.drafted.append(steps)
        stats.first_accepted += hit

        # 3. keep the accepted path in the target's cache; the last emitted token becomes pending.
        target.keep_path(base, path)
        committed.extend(tokens)
        for token in tokens:
            yield token
            emitted += 1
            if emitted >= max_new_tokens:
                return

