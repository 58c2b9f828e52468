"""An answer's constraint (structured output) over one bundle's vocabulary: compiled from its
``response_format`` or taken as compiled already, refused where the answer's loop cannot honour it.

The grammar engine's view of the bundle's tokenizer is built once, on the first constrained request.
"""

from __future__ import annotations

from collections.abc import Callable

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain import Constraint, GrammarVocabulary, grammar_for
from edge_spec.runtime.loaded import LoadedBundle
from edge_spec.runtime.loops import check_constraint
from edge_spec.runtime.loops.config import LoopConfig


class Constraints:
    """The constraints of one bundle's answers (see the module docstring)."""

    def __init__(self, bundle: LoadedBundle) -> None:
        self.bundle = bundle
        self._vocabulary: GrammarVocabulary | None = None

    def vocabulary(self) -> GrammarVocabulary:
        """The grammar engine's view of the bundle's tokenizer, built on the first constrained request."""
        if self._vocabulary is None:
            tokenizer = self.bundle.tokenizer
            self._vocabulary = GrammarVocabulary(
                tokenizer.tokenizer, self.bundle.target.vocab_size, tokenizer.eos_token_ids
            )
        return self._vocabulary

    def make(
        self,
        response_format: dict | Constraint | None,
        config: LoopConfig,
        *,
        grammar: str | None = None,
        vet: Callable[[str], None] | None = None,
    ) -> Constraint | None:
        """The constraint of one answer (None: unconstrained): ``response_format`` compiled here, or one
        compiled already (a server compiles each request's once, with this method), taken as it is: fresh
        and of this bundle's vocabulary.  Where the loop ``config`` cannot honour a constraint it is
        refused here, in one line (``ConstraintUnsupported``), before anything is compiled: the one place
        that is decided.  ``grammar``: ``grammar_for(response_format)`` when the caller has it already;
        ``vet(grammar)`` runs before the compile (a server checks the grammar in a child process it can
        stop at a time limit, ``constrain.isolated``)."""
        compiled = response_format if isinstance(response_format, Constraint) else None
        if compiled is None and grammar is None:
            grammar = grammar_for(response_format)
            if grammar is None:
                return None
        check_constraint(config)
        if compiled is not None:
            if compiled.tokens or compiled.vocabulary is not self.vocabulary():
                raise EdgeSpecError("response_format: a compiled constraint is fresh and of this model's vocabulary")
            return compiled
        if vet is not None:
            vet(grammar)
        return Constraint(grammar, self.vocabulary(), response_format)
