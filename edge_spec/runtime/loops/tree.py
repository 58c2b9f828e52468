"""Multi-draft speculative decoding: k branches from the pending token, one tree-shaped target pass.

Read it like :mod:`loops.chain`, of which it is the tree-shaped twin:

* Draft: the drafter catches up on ``committed`` and computes its distribution
  ``q`` at the root (the position after the pending token ``x``).  From it come
  k first tokens -- top-k when greedy; otherwise drawn by the scheme whose
  verifier follows (i.i.d. for RRS, without replacement for RRS-w/o, the
  hub pair for SpecHub, see :mod:`verify.tree`).  Each distinct first token
  starts a branch that the drafter extends into a chain of γ tokens
  (back at the root for every branch).
* Verify: one target pass over the tree ``[x, branch 1, branch 2, ...]``
  (:mod:`model.draft_tree`: tree mask, positions by depth).  The root row decides
  which branch, if any, survives -- greedy: the branch whose first token is the
  target's argmax; sampled: the multi-draft verifier's ladder.  Along the
  surviving branch the ordinary chain verifier runs on that branch's rows.
* Roll back: the target keeps only the accepted path, compacted in place
  (:meth:`Decoder.keep_path`); the drafter catches up next round.

Exactness: at the root the emitted token follows p because the verifier
matches how the first tokens were drawn (proved per verifier in
:mod:`verify.tree` and tested by enumeration); below it, a surviving branch
was drawn from q conditioned on its first token, so the chain verifier's usual
argument applies.  Greedy output is target-only greedy output, since every
emitted token is the target's argmax on its own prefix.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.loops.config import TreeConfig, check_sampling
from edge_spec.runtime.loops.request import Request
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.model.draft_tree import DraftTree
from edge_spec.runtime.propose.base import DraftBlock, DraftRule
from edge_spec.runtime.propose.model import ModelDrafter
from edge_spec.runtime.verify.chain import verify_chain
from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs, sample, scatter_probs
from edge_spec.runtime.verify.tree import draw_first_tokens, ladder_for


def check_tree(target: Decoder, config: TreeConfig, params: SamplingParams | None = None) -> None:
    """Refuse what the tree loop cannot honour on this target, in one clear line (greedy decoding
    branches on the drafter's top-k, so the verifier's draft count matters only when sampling;
    ``params`` None: checked again per request)."""
    if params is not None:
        check_sampling(config, params)
    if config.verifier == "spechub" and config.drafts != 2 and params is not None and not params.greedy:
        raise EdgeSpecError("SpecHub verifies exactly 2 drafts per step (--drafts 2)")
    if not target.supports_tree:
        raise EdgeSpecError(
            "this bundle's target graph has no tree-attention inputs; re-export it with this "
            "edge-spec version to use multi-draft decoding"
        )


def _root_drafts(
    logits: np.ndarray,
    ids: np.ndarray | None,
    params: SamplingParams,
    config: TreeConfig,
    vocab_size: int,
    rng: np.random.Generator,
) -> tuple[list[int], np.ndarray | None]:
    """The k first tokens (target ids) and, when sampling, the full-vocabulary q they came from."""
    if params.greedy:
        top = np.argsort(-logits, kind="stable")[: config.drafts]
        return [int(t) if ids is None else int(ids[t]) for t in top], None
    probs = logits_to_probs(logits, params)
    q = probs if ids is None else scatter_probs(probs, ids, vocab_size, validate=False)
    return draw_first_tokens(q, config.drafts, config.verifier, rng), q


def _verify_root(
    first_tokens: list[int],
    q_root: np.ndarray | None,
    root_row: np.ndarray,
    params: SamplingParams,
    verifier: str,
    rng: np.random.Generator,
) -> tuple[int, bool]:
    """The token emitted at the root and whether it is one of the drafts."""
    if params.greedy:
        best = int(np.argmax(root_row))
        return best, best in first_tokens
    p = logits_to_probs(root_row, params)
    if not first_tokens:
        return sample(p, rng), False
    return ladder_for(verifier, first_tokens, q_root, p).sample(rng)


def draft_branches(
    drafter: ModelDrafter,
    committed: list[int],
    depth: int,
    config: TreeConfig,
    params: SamplingParams,
    rng: np.random.Generator,
) -> tuple[list[DraftBlock], list[int], np.ndarray | None]:
    """The root distribution once, then one chain of ``depth`` tokens per distinct first token
    (a repeated first token shares its branch).  Returns the branches, the first tokens as drawn
    (what the root verifier needs) and the root q when sampling."""
    if depth == 0:
        return [], [], None
    logits, ids = drafter.next_logits(committed)
    first_tokens, q_root = _root_drafts(logits, ids, params, config, drafter.vocab_size, rng)
    branches = []
    for token in dict.fromkeys(first_tokens):
        rule = DraftRule(params, rng, depth - 1)
        block = drafter.propose(committed + [token], depth - 1, rule)
        block.tokens.insert(0, token)
        block.steps += 1 if not branches else 0  # the root step, counted once
        branches.append(block)
    return branches, first_tokens, q_root


def generate_tree(request: Request, config: TreeConfig) -> Iterator[int]:
    """Yield up to ``request.max_new_tokens`` ids, distributed exactly as target-only decoding would produce
    them; a cancel cuts or refuses the pass it meets (``Decoder.interrupt``)."""
    target, params, rng, max_new_tokens = request.target, request.params, request.rng, request.max_new_tokens
    check_tree(target, config, params)
    if request.drafter is None:
        raise EdgeSpecError("multi-draft decoding needs the drafter model among the proposers")
    yield from request.start()
    while not request.done:
        # 1. draft: the root distribution once, then one chain per distinct first token.
        clock = request.clock()
        depth = min(config.gamma, max_new_tokens - request.emitted - 1)
        if 1 + config.drafts * depth > target.capacity - (len(request.committed) - 1):
            depth = 0  # the tree would not fit in the context: a plain target step
        branches, first_tokens, q_root = draft_branches(request.drafter, request.committed, depth, config, params, rng)
        tree = DraftTree(request.pending, tuple(tuple(b.tokens) for b in branches))
        clock.drafted()

        # 2. verify: one pass over the whole tree; the root row picks the branch, its rows verify the chain.
        outputs = target.forward(tree.tokens, tree.size, tree=tree)
        rows = outputs["logits"]
        token, hit = _verify_root(first_tokens, q_root, rows[0], params, config.verifier, rng)
        path, tokens = [0], [token]
        if hit:
            branch = [b.tokens[0] for b in branches].index(token)
            chain, nodes = branches[branch], tree.nodes(branch)
            result = verify_chain(chain.tokens[1:], chain.q_rows, rows[nodes], params, rng, len(request.committed) + 1)
            path += nodes[: 1 + result.accepted]
            tokens = [token] + result.tokens
        clock.verified()
        tally = DraftBlock(request.drafter.name, steps=sum(b.steps for b in branches))
        request.record_round(tally, len(path) - 1, tokens, clock, drafted=tally.steps, first_accepted=hit)

        # 3. keep the accepted path in the target's cache; the last emitted token becomes pending.
        yield from request.accept(len(path) - 1, tokens, outputs, path=path)
