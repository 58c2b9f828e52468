"""An answer's tokens as the text chunks a caller sees: streaming detokenization, stop strings, and the
side channels that label each chunk's text by token (its sources, its log-probabilities).

Tokens whose text is not complete yet (a character split across tokens) and text that may be the
start of a stop string are held back until the next token settles them; what a stop string cuts off
is never handed out, neither its text nor its tokens' labels.
"""

from __future__ import annotations

from edge_spec.runtime.logprobs import ChunkLogprobs, TokenLogprob
from edge_spec.runtime.loops.stats import TARGET
from edge_spec.runtime.options import GenerateOptions
from edge_spec.runtime.provenance import SourcedText
from edge_spec.runtime.text import StopMatcher, StreamingDetokenizer, TextTokenizer


class TextStream:
    """Turns one answer's tokens into text chunks.  ``sources``: each token's source, by index, as the
    speculative loop fills it (None: every token is the target's); ``logprobs``: each token's entry,
    filled by the engine as tokens come."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        options: GenerateOptions,
        sources: list[str] | None,
        logprobs: list[TokenLogprob],
    ) -> None:
        self.options = options
        self.tracked = options.tracked  # text pieces labelled by token index
        if self.tracked:
            self.detok: SourcedText | StreamingDetokenizer = SourcedText(tokenizer)
        else:
            self.detok = StreamingDetokenizer(tokenizer, options.marked_tokens)
        self.stopper = StopMatcher(list(options.stop))
        self.sources = sources
        self.chunk_logprobs = ChunkLogprobs(logprobs) if options.on_logprobs is not None else None
        self.tokens = 0
        self.stopped = False

    def push(self, token: int) -> str:
        """The text ``token`` settles (maybe empty); :attr:`stopped` once a stop string was met."""
        pushed = self.detok.push(token, self.tokens) if self.tracked else self.detok.push(token)
        self.tokens += 1
        text, self.stopped = self.stopper.feed(pushed)
        self._label(text)
        return text

    def flush(self) -> str:
        """The text held back at the end of an answer that no stop string ended."""
        text, self.stopped = self.stopper.feed(self.detok.flush())
        text += "" if self.stopped else self.stopper.flush()
        self._label(text)
        return text

    def finish(self) -> None:
        """Label the last tokens, whose text is empty (their pieces join to "")."""
        if self.tracked and not self.stopped and self.detok.waiting():
            self._hand_out(self.detok.take_rest())

    def _label(self, text: str) -> None:
        if text and self.tracked:
            self._hand_out(self.detok.take(len(text)))

    def _hand_out(self, pieces: list[list]) -> None:
        """The side channels asked for, for the tokens of ``pieces`` ([[text, token index], ...])."""
        if self.options.on_sources is not None:
            sources = self.sources
            self.options.on_sources([[piece, sources[i] if sources is not None else TARGET] for piece, i in pieces])
        if self.chunk_logprobs is not None:
            self.options.on_logprobs(self.chunk_logprobs.take(pieces))
