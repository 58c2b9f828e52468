"""Where each piece of a streamed answer came from: the proposer whose accepted draft it was, or the target.

The speculative loops record one source per emitted token (``SpecStats.token_sources``: "model" for the
drafter model, "suffix", "lookup", "forced", "guess", "eagle", or "target" for the target's own tokens -- the first
one, corrections and bonuses); in ar mode every token is the target's.  Text does not come out token by
token, though: the detokenizer holds back an unfinished UTF-8 character (one delta then covers several
tokens) and a stop matcher holds back text that may begin a stop string.  :class:`SourcedText` is the
engine's detokenizer that also keeps, for every character it has released, the token it came from, so
the text the engine yields can be handed out with its pieces: ``[[text, source], ...]``, one entry per
token, whose texts join to exactly the yielded text.

A token whose text is empty completed no character on its own (the first bytes of a character another
token ends, or a token that decodes to nothing) and goes with the next hand-out, or with the rest
(:meth:`SourcedText.take_rest`) at the end of the answer; a token whose text a stop-string hold-back cut
in two appears in two consecutive hand-outs, and tokens after a stop string in none.
Nothing here touches which tokens are generated: it only reads them.
"""

from __future__ import annotations

from collections import deque

from edge_spec.runtime.loops.stats import TARGET
from edge_spec.runtime.text import StreamingDetokenizer, TextTokenizer


class SourcedText(StreamingDetokenizer):
    """:class:`StreamingDetokenizer` that also tracks the source of every character (see the module
    docstring): :meth:`push` takes each token's source, :meth:`take` hands out the pieces of the next
    ``length`` characters of the released text."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        super().__init__(tokenizer)
        self.sources: list[str] = []  # parallel to ``ids``
        self._pieces: deque[list[str]] = deque()  # [text, source] decoded, not yet handed out

    def push(self, token_id: int, source: str = TARGET) -> str:
        start, read = self._prefix_offset, self._read_offset
        self.sources.append(source)
        delta = super().push(token_id)
        if delta:
            self._split(start, read, delta)
        return delta

    def flush(self) -> str:
        start, read = self._prefix_offset, self._read_offset
        delta = super().flush()
        if delta:
            self._split(start, read, delta)
        else:  # the last tokens decode to nothing
            self._pieces.extend(["", source] for source in self.sources[read:])
        return delta

    def take(self, length: int) -> list[list[str]]:
        """The ``[text, source]`` pieces of the next ``length`` released characters (with the empty pieces
        of the tokens that completed no character before them)."""
        out: list[list[str]] = []
        while self._pieces and length > 0:
            text, source = self._pieces[0]
            if len(text) > length:  # the rest of this token's text goes out with a later hand-out
                out.append([text[:length], source])
                self._pieces[0][0] = text[length:]
                return out
            out.append(self._pieces.popleft())
            length -= len(text)
        return out

    def waiting(self) -> bool:
        """Whether pieces are left that no hand-out took (at the end: tokens whose text is empty)."""
        return bool(self._pieces)

    def take_rest(self) -> list[list[str]]:
        """Every piece left, for the end of the answer."""
        rest = [piece for piece in self._pieces]
        self._pieces.clear()
        return rest

    def _split(self, start: int, read: int, delta: str) -> None:
        """Queue ``delta`` (the text of ``ids[read:]`` after the window ``ids[start:read]``) token by token:
        each token gets the characters that became complete with it; the last gets the rest."""
        end = len(self.ids)
        done = 0
        if end - read > 1:
            base = self.tok.decode(self.ids[start:read])
            for j in range(read, end - 1):
                text = self.tok.decode(self.ids[start : j + 1])
                upto = text[len(base) :].rstrip("\ufffd") if text.startswith(base) else ""
                if len(upto) > done and delta.startswith(upto):
                    self._pieces.append([delta[done : len(upto)], self.sources[j]])
                    done = len(upto)
                else:
                    self._pieces.append(["", self.sources[j]])
        self._pieces.append([delta[done:], self.sources[end - 1]])
