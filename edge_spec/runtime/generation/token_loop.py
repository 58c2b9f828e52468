"""One answer's token loop over the bundle's models: the loop its configuration names with that loop's
drafter, proposers and schedule memory, and the models it runs, which the engine follows and cancels.

Everything here comes from the answer's own configuration, never the engine's: a call in another mode
drafts with, watches and prices the drafter of that mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from edge_spec.runtime.constrain import Constraint
from edge_spec.runtime.loaded import LoadedBundle, drafter_name
from edge_spec.runtime.loops import Request, generate_tokens, proposers_for
from edge_spec.runtime.loops.config import LoopConfig
from edge_spec.runtime.loops.stats import SpecStats
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.propose.context import ProposerContext
from edge_spec.runtime.schedule.memory import ScheduleMemory
from edge_spec.runtime.verify.sampling import SamplingParams


@dataclass
class TokenLoop:
    tokens: Iterator[int]
    decoders: list[Decoder]  # the models it runs: the target, then its drafter's
    memory: ScheduleMemory | None  # the chain schedule's calibration (None: target-only decoding)


def token_loop(
    bundle: LoadedBundle,
    config: LoopConfig,
    prompt_ids: list[int],
    params: SamplingParams,
    max_new_tokens: int,
    stats: SpecStats,
    constraint: Constraint | None,
) -> TokenLoop:
    """The token loop of one answer in ``config``; nothing runs before its first token is asked for."""
    target, speculative = bundle.target, config.mode != "ar"
    drafter = bundle.active_drafter(config) if speculative else None
    drafters = {drafter_name(config): drafter} if drafter is not None else {}
    context = ProposerContext(target.vocab_size, drafters, suffix_cache=bundle.suffix_cache)
    memory = bundle.schedule_memory(config) if speculative else None
    rng = np.random.default_rng(params.seed)
    proposers = proposers_for(config, context, constraint)
    request = Request(target, proposers, prompt_ids, params, rng, max_new_tokens, stats, constraint, memory)
    if drafter is None:
        return TokenLoop(generate_tokens(config, request), [target], memory)
    return TokenLoop(generate_tokens(config, request), [target, drafter.decoder], memory)
