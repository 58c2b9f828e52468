"""Proposers: everything that drafts tokens for the target to verify, behind one interface (``base.Proposer``).

Adding one is a new module plus one line in ``PROPOSERS``; a loop's configuration names the
proposers it uses, in order of preference.
"""

from __future__ import annotations

from collections.abc import Callable

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.propose.base import Proposer
from edge_spec.runtime.propose.context import ProposerContext
from edge_spec.runtime.propose.guess import FreeGuess
from edge_spec.runtime.propose.lookup import PromptLookup


def _drafter_model(context: ProposerContext) -> Proposer:
    if context.drafter is None:
        raise EdgeSpecError("this bundle has no drafter model")
    return context.drafter


PROPOSERS: dict[str, Callable[[ProposerContext], Proposer]] = {
    "model": _drafter_model,
    "lookup": PromptLookup,
    "guess": FreeGuess,
}


def build_proposers(names: tuple[str, ...], context: ProposerContext) -> list[Proposer]:
    """One request's proposers, in the configured order."""
    unknown = [n for n in names if n not in PROPOSERS]
    if unknown:
        raise EdgeSpecError(f"unknown proposer {unknown[0]!r}; choose from: {', '.join(PROPOSERS)}")
    return [PROPOSERS[name](context) for name in names]
