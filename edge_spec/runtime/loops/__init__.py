"""Token loops: target-only decoding and the speculative loops (chain, tree, SSD), one per configuration type.

Every loop takes the same two values: the :class:`~edge_spec.runtime.loops.request.Request` (the target,
the proposers, the prompt, the sampling, the budget, the statistics, a constraint, the schedule's
memory) and its configuration; :data:`LOOPS` names each configuration type's loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain import Constraint
from edge_spec.runtime.loops.autoregressive import generate_autoregressive
from edge_spec.runtime.loops.chain import generate_chain
from edge_spec.runtime.loops.config import ArConfig, ChainConfig, LoopConfig, SsdConfig, TreeConfig
from edge_spec.runtime.loops.request import Request
from edge_spec.runtime.loops.ssd import generate_ssd
from edge_spec.runtime.loops.tree import generate_tree
from edge_spec.runtime.propose import build_proposers
from edge_spec.runtime.propose.base import Proposer
from edge_spec.runtime.propose.context import ProposerContext

__all__ = [
    "LOOPS",
    "ConstraintUnsupported",
    "Request",
    "check_constraint",
    "generate_tokens",
    "proposer_names",
    "proposers_for",
]

LOOPS: dict[type, Callable[[Request, LoopConfig], Iterator[int]]] = {
    ArConfig: generate_autoregressive,
    ChainConfig: generate_chain,
    TreeConfig: generate_tree,
    SsdConfig: generate_ssd,
}


def proposer_names(config: LoopConfig) -> tuple[str, ...]:
    """The proposers a loop drafts with: the chain's are configured; tree and SSD draft with the drafter
    model (the default drafter), target-only decoding with none."""
    return config.proposers


class ConstraintUnsupported(EdgeSpecError):
    """The loop cannot constrain an answer (the message says which loops can)."""


def proposers_for(config: LoopConfig, context: ProposerContext, constraint: Constraint | None = None) -> list[Proposer]:
    """The proposers of one request in the loop ``config`` names (none in target-only decoding); under a
    ``constraint`` the tokens it forces are drafted first."""
    names = proposer_names(config)
    if not names:
        return []
    if constraint is not None and "forced" not in names:
        names = ("forced",) + names
    return build_proposers(names, context)


def check_constraint(config: LoopConfig) -> None:
    """Refuse, in one line, a constraint the loop cannot honour: only target-only decoding and the chain
    mask what they verify.  Decided once per answer, where its constraint is made
    (``Engine.constraint_for``); the loops take the constraint they are given."""
    if not isinstance(config, (ArConfig, ChainConfig)):
        raise ConstraintUnsupported(
            "response_format (constrained output) runs in --mode ar and one-chain spec, not in "
            "multi-draft spec (--drafts > 1) or --mode ssd"
        )


def generate_tokens(config: LoopConfig, request: Request) -> Iterator[int]:
    """The token stream of ``request`` in the loop ``config`` names (a constraint only for an ar or chain
    ``config``: :func:`check_constraint`, which the engine asks before it makes one).  A cancel is the
    decoders': a pass it cuts or refuses ends the stream with ``PassInterrupted``, having yielded only
    tokens the target verified (see ``Decoder.interrupt``)."""
    return _leaving_target_only_cache(LOOPS[type(config)](request, config), request)


def _leaving_target_only_cache(tokens: Iterator[int], request: Request) -> Iterator[int]:
    """``tokens``, and once they end (exhausted, closed by the caller at an end token or a stop, or cut by
    a cancel) the target's cache cut to what target-only decoding leaves: the prompt and the tokens given
    before the last.  A speculative loop may hold more (an accepted draft of the end token, drafts past
    it), computed by the decode graph; the next turn reads from there on through whichever graph reads
    prompts, so without the cut a prompt graph's other rounding would make a conversation's later turns
    depend on how the earlier answers were decoded."""
    given = 0
    try:
        for token in tokens:
            given += 1
            yield token
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()
        target = request.target
        keep = len(request.prompt_ids) + max(given - 1, 0)
        if target.length > keep:
            target.rewind(keep)
