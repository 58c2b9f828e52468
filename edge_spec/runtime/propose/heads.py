"""Drafter LM heads: final hidden state -> logits over some rows of the vocabulary, plus which rows.

Keeping heads outside the drafter body lets one bundle carry several heads over
one body: the full vocabulary, VocabTrim subsets (a fixed set of rows) and
SpecVocab (a set of rows chosen anew at every step).  Every head answers
``(logits, ids)``: ``logits[j]`` is the drafter's logit for target token
``ids[j]`` (``ids`` None: the whole vocabulary, in order).  Tokens outside
``ids`` have q = 0, which verification handles exactly.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from edge_spec.defaults import DEFAULT_PROVIDER, DEFAULT_THREADS
from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.model.session import small_session


def rows_of(ids: np.ndarray, universe: np.ndarray | None) -> np.ndarray:
    """Scorer rows of the target ``ids`` (those inside ``universe``; all of them when it is None)."""
    if universe is None:
        return ids
    pos = np.searchsorted(universe, ids).clip(0, len(universe) - 1)
    return pos[universe[pos] == ids]


class DraftHead:
    """A static head: ``vocab_ids[j]`` is the target id of head row j (None: full vocabulary)."""

    def __init__(
        self,
        model_path: Path,
        *,
        provider: str = DEFAULT_PROVIDER,
        threads: int = DEFAULT_THREADS,
        vocab_ids: np.ndarray | None = None,
        provider_options: dict[str, str] | None = None,
    ) -> None:
        self.session = small_session(model_path, provider, threads, provider_options=provider_options)
        self.rows = int(self.session.get_outputs()[0].shape[-1])
        if vocab_ids is not None and len(vocab_ids) != self.rows:
            raise EdgeSpecError(f"{model_path}: head has {self.rows} rows but its vocabulary map {len(vocab_ids)}")
        self.vocab_ids = vocab_ids
        self.seconds = 0.0  # time spent in this head (draft-cost accounting)

    def __call__(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """hidden [H] (one position) -> (logits [rows], ids [rows] or None)."""
        started = time.perf_counter()
        logits = self.session.run(None, {"hidden_states": hidden[None, None]})[0][0, 0]
        self.seconds += time.perf_counter() - started
        return logits, self.vocab_ids


class SpecVocabHead:
    """SpecVocab: per-step candidate rows picked by a low-rank scorer, exact logits on those rows only.

    The scorer (an int4 ORT graph, rank R) ranks the whole vocabulary; the top
    ``candidates`` rows, plus ``always_ids`` (a static VocabTrim set and the
    end-of-turn tokens), are gathered from an int8 copy of the head and dotted
    with the hidden state in numpy - a few hundred thousand multiply-adds instead
    of the full head's 136M.
    """

    def __init__(
        self,
        scorer_path: Path,
        rows_path: Path,
        scales_path: Path,
        candidates: int,
        *,
        always_ids: np.ndarray | None = None,
        universe: np.ndarray | None = None,
        rows_by_universe: bool = False,
        provider: str = DEFAULT_PROVIDER,
        threads: int = DEFAULT_THREADS,
        provider_options: dict[str, str] | None = None,
    ) -> None:
        self.session = small_session(scorer_path, provider, threads, provider_options=provider_options)
        for path in (rows_path, scales_path):
            if not Path(path).is_file():
                raise EdgeSpecError(f"SpecVocab head file not found: {path}")
        self.rows = np.load(rows_path, mmap_mode="r")  # int8 [V, H], paged in as rows are gathered
        self.scales = np.load(scales_path)  # float32 [V]
        self.always = np.asarray(always_ids if always_ids is not None else [], np.int64)
        # universe: target ids of the scorer's rows when it ranks a VocabTrim subset (None: all ids)
        self.universe = universe
        self._always_rows = rows_of(self.always, universe)
        # rows_by_universe: the int8 table holds the universe's rows only (row j: target id universe[j]),
        # as for the EAGLE head's draft vocabulary; else row i is target id i
        self.rows_by_universe = rows_by_universe
        if rows_by_universe and (universe is None or len(self._always_rows) != len(self.always)):
            raise EdgeSpecError(f"{rows_path}: a head whose rows follow its universe needs every always-kept id in it")
        self.candidates = int(candidates)
        self._gap: float | None = None  # score spread that holds the top candidates (see _select)
        self.vocab_ids = None  # no fixed vocabulary: ids come with every call
        self.seconds = 0.0

    def __call__(self, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        started = time.perf_counter()
        scores = self.session.run(None, {"hidden_states": hidden[None, None]})[0][0, 0]
        chosen = self._select(scores)
        ids = chosen if self.universe is None else self.universe[chosen]
        if self.always.size:
            ids = np.concatenate([ids, self.always])
        rows = np.concatenate([chosen, self._always_rows]) if self.rows_by_universe else ids
        logits = (self.rows[rows].astype(np.float32) @ hidden.astype(np.float32)) * self.scales[rows]
        self.seconds += time.perf_counter() - started
        return logits, ids

    def _select(self, scores: np.ndarray) -> np.ndarray:
        """The scorer rows of the ``candidates`` best-scored ids, the always-kept ones left out (the
        caller appends those).

        A full ``argpartition`` over 150k scores costs about as much as the scorer
        itself, so we first keep only scores within ``gap`` of the best (one
        compare over the array) and partition that short list; ``gap`` tracks
        the spread of the last steps' top-k.  Which k rows win does not affect
        exactness, only speed: any candidate set gives a valid q.
        """
        scores[self._always_rows] = -np.inf  # appended below, so never picked twice
        k = min(self.candidates, scores.size - self._always_rows.size)
        best = float(scores.max())
        short = np.flatnonzero(scores >= best - self._gap) if self._gap is not None else None
        if short is None or short.size < k:  # no estimate yet, or the spread grew: partition everything
            short = np.arange(scores.size)
        chosen = short[np.argpartition(scores[short], short.size - k)[short.size - k :]]
        spread = best - float(scores[chosen].min())
        self._gap = 1.5 * spread if self._gap is None else 0.8 * self._gap + 0.2 * 1.5 * spread
        return chosen
