"""The grammar checker's child process (``python -m edge_spec.runtime.constrain.child``, see :mod:`isolated`):
reads the vocabulary, then answers each grammar with the reason it is refused, or null, until stdin closes."""

from __future__ import annotations

import os
import sys

from tokenizers import Tokenizer

from edge_spec.runtime.constrain.compile import GrammarRefused, compile_grammar
from edge_spec.runtime.constrain.grammar import first_line
from edge_spec.runtime.constrain.isolated import receive, send
from edge_spec.runtime.constrain.vocabulary import GrammarVocabulary


def serve() -> None:
    """Answer on a copy of stdout; the stdout file descriptor itself goes to stderr, so that nothing else
    printed there (a library's warning) can corrupt an answer."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = sys.stdin.buffer
    setup = receive(requests)
    if setup is None:
        return
    vocabulary = GrammarVocabulary(Tokenizer.from_str(setup["source"]), setup["width"], setup["end_ids"])
    send(answers, {"ready": True})
    while (message := receive(requests)) is not None:
        try:
            compile_grammar(message["grammar"], vocabulary)
            reason = None
        except GrammarRefused as exc:
            reason = str(exc)
        except Exception as exc:  # noqa: BLE001  (the grammar engine's own failure is the grammar's refusal)
            reason = f"the grammar engine failed on it: {first_line(exc)}"
        send(answers, {"reason": reason})


if __name__ == "__main__":
    serve()
