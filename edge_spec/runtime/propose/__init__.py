"""Proposers: everything that drafts tokens for the target to verify, behind one interface (``base.Proposer``).

Adding one is a new module plus one line in ``PROPOSERS``; a loop's configuration names the
proposers it uses, in order of preference.
"""

from __future__ import annotations

from collections.abc import Callable

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.propose.base import Proposer
from edge_spec.runtime.propose.context import ProposerContext
from edge_spec.runtime.propose.forced import ForcedTokens
from edge_spec.runtime.propose.guess import FreeGuess
from edge_spec.runtime.propose.lookup import PromptLookup
from edge_spec.runtime.propose.suffix import SuffixDrafts


def _loaded(name: str) -> Callable[[ProposerContext], Proposer]:
    """A drafter the engine loaded (it outlives the request)."""

    def get(context: ProposerContext) -> Proposer:
        if name not in context.drafters:
            raise EdgeSpecError(f"no {name!r} drafter is loaded for this request")
        return context.drafters[name]

    return get


PROPOSERS: dict[str, Callable[[ProposerContext], Proposer]] = {
    "model": _loaded("model"),  # the drafter model (propose.model)
    "eagle": _loaded("eagle"),  # the EAGLE-3 head on the target's features (propose.eagle)
    "lookup": PromptLookup,
    "suffix": SuffixDrafts,  # this request and earlier answers (the engine's suffix cache), longest match
    "guess": FreeGuess,
    "forced": ForcedTokens,  # tokens a constraint's grammar forces (drafted only under one)
}
DRAFTERS = ("model", "eagle")  # the proposers that are models: a chain drafts with one of them


def build_proposers(names: tuple[str, ...], context: ProposerContext) -> list[Proposer]:
    """One request's proposers, in the configured order."""
    unknown = [n for n in names if n not in PROPOSERS]
    if unknown:
        raise EdgeSpecError(f"unknown proposer {unknown[0]!r}; choose from: {', '.join(PROPOSERS)}")
    return [PROPOSERS[name](context) for name in names]
