"""Token log-probabilities: what the target thought of each token it emitted, and of the alternatives.

The distribution reported is the target's own at that position: the log-softmax of its raw logits, before
temperature, top-k, top-p or a constraint's mask (what OpenAI and vLLM report by default).  The sampling
settings change which tokens are drawn, never the numbers reported; under a constraint the numbers are the
model's too, not renormalised over the tokens the grammar allowed.

Every loop computes them from the rows it already has: target-only decoding from its one row per token,
the speculative loops from the verify pass's row for each emitted token (the first token from the prefill).
They are computed only when asked for (``SpecStats.token_logprobs``), one log-softmax per emitted token, so
asking costs about a millisecond per token at a 150k vocabulary and never changes a token: the loops read
the rows, they do not touch what is drawn from them.  In exact greedy decoding the verify rows are the rows
target-only decoding computes bit for bit, so the two modes report the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from edge_spec.errors import EdgeSpecError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the ``k`` most likely tokens there with theirs, most
    likely first (ties: lowest id first).  ``text_offset``: where the token's text begins in the answer,
    in characters (set when the engine hands the token out with a text chunk; -1 before)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    text_offset: int = -1


def check_top(top: object) -> int:
    """``top`` as the number of alternatives to report, refused in one line outside 0..20."""
    if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise EdgeSpecError(
            f"logprobs takes the number of top alternatives to report, 0 to {MAX_TOP_LOGPROBS}, not {top!r}"
        )
    return int(top)


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s entry under the raw ``logits`` row of its position (one log-softmax, in float64)."""
    row = np.asarray(logits, dtype=np.float64)
    peak = row.max()
    log_total = peak + np.log(np.exp(row - peak).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top:
        ids = np.argpartition(-row, top - 1)[:top] if top < row.size else np.arange(row.size)
        ids = ids[np.lexsort((ids, -row[ids]))]  # most likely first, ties by id
        best = tuple((int(i), float(row[i] - log_total)) for i in ids)
    return TokenLogprob(int(token), float(row[token] - log_total), best)


class LogprobRecorder:
    """The entries of a request's emitted tokens, in emission order: a loop calls :meth:`record` with each
    token's raw target row just before yielding the token."""

    def __init__(self, top: int) -> None:
        self.top = check_top(top)
        self.entries: list[TokenLogprob] = []

    def record(self, logits: np.ndarray, token: int) -> None:
        self.entries.append(token_logprob(logits, token, self.top))


class ChunkLogprobs:
    """Which tokens go with each text chunk the engine yields: those whose text begins in it.

    ``take`` reads a chunk's pieces (``[[text, token index], ...]`` from :class:`~provenance.SourcedText`,
    one per token, in order; a token whose text a stop-string hold-back cut in two has a piece in two
    chunks and goes with the first) and returns their entries with their ``text_offset``."""

    def __init__(self, entries: list[TokenLogprob]) -> None:
        self.entries = entries  # one per emitted token, by index (filled as tokens arrive)
        self.handed = 0  # tokens handed out so far
        self.offset = 0  # characters handed out so far

    def take(self, pieces: list[list]) -> list[TokenLogprob]:
        out = []
        for text, index in pieces:
            while self.handed <= index:
                out.append(replace(self.entries[self.handed], text_offset=self.offset))
                self.handed += 1
            self.offset += len(text)
        return out
