"""Proposers: everything that drafts tokens for the target to verify, behind one interface (``base.Proposer``).

Adding one is a new module plus one line in ``PROPOSERS``; a model drafter (a model of its own, loaded
from the bundle) is a ``drafters.DrafterSpec`` plus one line in ``drafters.DRAFTERS``.  A loop's
configuration names the proposers it uses, in order of preference.
"""

from __future__ import annotations

from collections.abc import Callable

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.propose.base import Proposer
from edge_spec.runtime.propose.context import ProposerContext
from edge_spec.runtime.propose.drafters import DRAFTERS
from edge_spec.runtime.propose.forced import ForcedTokens
from edge_spec.runtime.propose.guess import FreeGuess
from edge_spec.runtime.propose.lookup import PromptLookup
from edge_spec.runtime.propose.suffix import SuffixDrafts


def _loaded(name: str, context: ProposerContext) -> Proposer:
    """A model drafter (``drafters.DRAFTERS``) the engine loaded: it outlives the request."""
    if name not in context.drafters:
        raise EdgeSpecError(f"no {name!r} drafter is loaded for this request")
    return context.drafters[name]


# the proposers that are not models of their own (the model drafters: ``drafters.DRAFTERS``)
PROPOSERS: dict[str, Callable[[ProposerContext], Proposer]] = {
    "lookup": PromptLookup,
    "suffix": SuffixDrafts,  # this request and earlier answers (the engine's suffix cache), longest match
    "guess": FreeGuess,
    "forced": ForcedTokens,  # tokens a constraint's grammar forces (drafted only under one)
}


def build_proposers(names: tuple[str, ...], context: ProposerContext) -> list[Proposer]:
    """One request's proposers, in the configured order."""
    unknown = [n for n in names if n not in PROPOSERS and n not in DRAFTERS]
    if unknown:
        known = [*DRAFTERS, *PROPOSERS]
        raise EdgeSpecError(f"unknown proposer {unknown[0]!r}; choose from: {', '.join(known)}")
    return [_loaded(name, context) if name in DRAFTERS else PROPOSERS[name](context) for name in names]
