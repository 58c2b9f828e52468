"""Token loops: target-only decoding and the speculative loops (chain, tree, SSD), one per configuration type."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain import Constraint
from edge_spec.runtime.loops.autoregressive import generate_autoregressive
from edge_spec.runtime.loops.chain import generate_chain
from edge_spec.runtime.loops.config import ArConfig, ChainConfig, LoopConfig, SsdConfig, TreeConfig
from edge_spec.runtime.loops.ssd import generate_ssd
from edge_spec.runtime.loops.stats import SpecStats
from edge_spec.runtime.loops.tree import generate_tree
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.propose import build_proposers
from edge_spec.runtime.propose.context import ProposerContext
from edge_spec.runtime.propose.drafters import DEFAULT_DRAFTER
from edge_spec.runtime.schedule.memory import ScheduleMemory
from edge_spec.runtime.verify.sampling import SamplingParams

SPECULATIVE_LOOPS = {ChainConfig: generate_chain, TreeConfig: generate_tree, SsdConfig: generate_ssd}


def proposer_names(config: LoopConfig) -> tuple[str, ...]:
    """The proposers a loop drafts with: the chain's are configured; tree and SSD draft with the
    drafter model (the default drafter)."""
    return config.proposers if isinstance(config, ChainConfig) else (DEFAULT_DRAFTER,)


class ConstraintUnsupported(EdgeSpecError):
    """The loop cannot constrain an answer (the message says which loops can)."""


def check_constraint(config: LoopConfig) -> None:
    """Refuse, in one line, a constraint the loop cannot honour: only target-only decoding and the chain
    mask what they verify.  Decided once per answer, where its constraint is made
    (``Engine.constraint_for``); the loops take the constraint they are given."""
    if not isinstance(config, (ArConfig, ChainConfig)):
        raise ConstraintUnsupported(
            "response_format (constrained output) runs in --mode ar and one-chain spec, not in "
            "multi-draft spec (--drafts > 1) or --mode ssd"
        )


def generate_tokens(
    config: LoopConfig,
    target: Decoder,
    context: ProposerContext,
    prompt_ids: list[int],
    params: SamplingParams,
    rng: np.random.Generator,
    max_new_tokens: int,
    stats: SpecStats | None = None,
    memory: ScheduleMemory | None = None,
    constraint: Constraint | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[int]:
    """The token stream of one request in the loop ``config`` names (``memory``: the chain schedule's
    carried calibration, see ``schedule.memory``; ``constraint``: what the answer may contain, fresh,
    followed token by token, for an ar or chain ``config`` (:func:`check_constraint`, which the engine
    asks before it makes one); the chain then drafts the tokens it forces first).  ``should_stop()``
    (e.g. a cancel event's ``is_set``) is asked before every model pass after the prompt's: once True
    the stream ends there, mid-round, having yielded only tokens the target verified, and without
    the round's verify pass."""
    if isinstance(config, ArConfig):
        return generate_autoregressive(
            target,
            prompt_ids,
            params,
            rng,
            max_new_tokens,
            constraint,
            stats.token_logprobs if stats is not None else None,
            should_stop,
        )
    names = proposer_names(config)
    if constraint is not None and "forced" not in names:
        names = ("forced",) + names
    proposers = build_proposers(names, context)
    if isinstance(config, ChainConfig):
        return generate_chain(
            target, proposers, prompt_ids, params, rng, max_new_tokens, config, stats, memory, constraint, should_stop
        )
    loop = SPECULATIVE_LOOPS[type(config)]
    return loop(target, proposers, prompt_ids, params, rng, max_new_tokens, config, stats, should_stop=should_stop)
