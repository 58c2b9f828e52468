"""Compiling a grammar for one bundle's vocabulary, refused in one line when it cannot constrain an answer.

A schema or grammar in a request is someone else's input, and what it costs the grammar engine is not in
proportion to its size: a pattern of nested counts (``^(a{1000}){1000}$``) keeps llguidance's lexer
busy for seconds and then fails a few tokens into the answer; a schema of some thousands of optional
properties compiles for minutes.  So a grammar is compiled under :data:`LIMITS` (llguidance's own
bounds on grammar size, lexer states and the work of one step) and the compile goes on through the
first steps of an answer, the first token mask and the tokens the grammar forces from there, where a
lexer limit shows.  :func:`compile_grammar` refuses (:class:`GrammarRefused`, the reason in one line):

* a grammar llguidance cannot compile, or that passes one of its limits (the reason names it);
* a grammar that accepts no text at all: an unsatisfiable schema llguidance itself lets through, such
  as a ``$ref`` that refers only to itself (``a`` → ``b`` → ``a``), whose first mask allows only the end
  of the answer although nothing has been written;
* a grammar that accepts only the empty answer, which would answer every request with nothing.

The time a compile takes is bounded apart (no limit of llguidance bounds it): a server compiles each
request's grammar first in a child process that is ended at a time limit (:mod:`isolated`).
"""

from __future__ import annotations

import numpy as np
from llguidance import LLMatcher, LLParserLimits
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.constrain.grammar import first_line
from edge_spec.runtime.constrain.vocabulary import GrammarVocabulary

# llguidance's defaults (grammar size 500,000 symbols, 250,000 lexer states, 1,000,000 fuel to build the
# lexer, 200,000 per step, 2,000 Earley items per row, 50,000 per step), with its errors kept short: a
# verbose error carries the parser state and grammar, which a request's error must not echo back
LIMITS = {"verbose_errors": False}
FORCED_PROBE = 64  # forced tokens consumed when checking where the answer goes first


class GrammarRefused(EdgeSpecError):
    """A grammar that cannot constrain an answer; the message is the reason, without the field's name."""


def parser_limits() -> LLParserLimits:
    return LLParserLimits(**LIMITS)


def token_mask(matcher: LLMatcher, width: int) -> np.ndarray:
    """Boolean mask over ``width`` rows: the tokens ``matcher`` allows next (the end tokens included where
    the grammar may stop)."""
    bits = allocate_token_bitmask(1, width)
    fill_next_token_bitmask(matcher, bits, 0)
    return np.unpackbits(bits.astype("<i4", copy=False).view(np.uint8), bitorder="little", count=width).view(bool)


def compile_grammar(grammar: str, vocabulary: GrammarVocabulary) -> LLMatcher:
    """The grammar engine's matcher for ``grammar`` (from ``grammar_for``) in its initial state, else
    :class:`GrammarRefused` with the reason (see the module docstring).  Blocking, and as slow as the
    grammar makes it: a server runs it in a child process under a time limit first (:mod:`isolated`)."""
    matcher = LLMatcher(vocabulary.library, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise GrammarRefused(f"the grammar engine cannot compile it: {first_line(matcher.get_error())}")
    probe = matcher.deep_copy()
    allowed = token_mask(probe, vocabulary.width) & vocabulary.usable
    allowed[list(vocabulary.end_ids)] = False
    if not allowed.any():
        if probe.is_accepting() and not probe.is_error():
            raise GrammarRefused("it accepts only an empty answer")
        raise GrammarRefused(
            "it accepts no text at all (unsatisfiable: a $ref that refers only to itself, or bounds no value meets)"
        )
    forced = probe.compute_ff_tokens()[:FORCED_PROBE] if not probe.is_error() else []
    if forced and probe.consume_tokens(forced):
        token_mask(probe, vocabulary.width)
    if probe.is_error():
        raise GrammarRefused(f"the grammar engine cannot follow it: {first_line(probe.get_error())}")
    return matcher
