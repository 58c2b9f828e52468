"""Constraints: what a request may draft and emit (structured output: a JSON schema, any JSON object).

A :class:`Constraint` follows one answer token by token and says which of the target's token ids may come
next (:meth:`Constraint.allowed`), which tokens the grammar forces (:meth:`Constraint.forced_tokens`), and
takes tokens back when drafts are rejected (:meth:`Constraint.rollback`).  The grammar engine is
llguidance; its tokenizer side (:class:`GrammarVocabulary`) is built once per bundle.  This layer knows
nothing of models, proposers or loops: the loops mask the target's rows with it, the drafters their
proposals, and the forced tokens are a proposer of their own (``propose.forced``).  A JSON schema is
also shown to the model, as one system instruction (:mod:`instruction`).  A grammar is compiled under
limits and refused when it cannot constrain an answer (:mod:`compile`), a pattern bomb before anything
compiles it (:mod:`patterns`); a server checks each request's grammar first in a child process it can
stop at a time limit (:mod:`isolated`).
"""

from edge_spec.runtime.constrain.compile import GrammarRefused, compile_grammar
from edge_spec.runtime.constrain.constraint import Constraint, ConstraintViolation
from edge_spec.runtime.constrain.grammar import RESPONSE_FORMATS, grammar_for, self_reference
from edge_spec.runtime.constrain.instruction import schema_instruction, with_instruction
from edge_spec.runtime.constrain.isolated import COMPILE_SECONDS, CheckerBusy, GrammarChecker, checker_for
from edge_spec.runtime.constrain.patterns import MAX_EXPANSION, pattern_problem, schema_pattern_problem
from edge_spec.runtime.constrain.vocabulary import GrammarVocabulary

__all__ = [
    "COMPILE_SECONDS",
    "MAX_EXPANSION",
    "CheckerBusy",
    "Constraint",
    "ConstraintViolation",
    "GrammarChecker",
    "GrammarRefused",
    "GrammarVocabulary",
    "RESPONSE_FORMATS",
    "checker_for",
    "compile_grammar",
    "grammar_for",
    "pattern_problem",
    "schema_pattern_problem",
    "self_reference",
    "schema_instruction",
    "with_instruction",
]
