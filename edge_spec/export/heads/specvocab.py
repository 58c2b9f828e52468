"""SpecVocab scorer: a low-rank map from the drafter's hidden state to approximate logits over the vocabulary.

Why: the drafter's LM head (151,936 x 896 for Qwen2.5-0.5B) is a large share of a
draft step, but only the few tokens with the highest logits matter for drafting.
SpecVocab (arXiv 2602.13836) ranks the whole vocabulary cheaply with
``s_hat = W_vocab (W_down h)`` (rank R << H), keeps the top-k candidates and
computes exact logits only for those rows.  Tokens outside the candidates get
q = 0; verification stays exact because it sees the q the draft was drawn from.

The scorer is built without training, from the head matrix ``W`` [V, H]:

* ``svd``:  the best rank-R approximation of ``W`` itself (truncated SVD).
* ``data``: the best rank-R approximation *on real drafter hidden states*:
  minimise E||W h - A B h||^2 over calibration states h.  With the second-moment
  matrix C = E[h h^T] = L L^T this is ||(W - A B) L||_F, solved exactly by the
  SVD of W L: A = W L V_r, B = V_r^T L^-1 (V_r: top-r right singular vectors).
  Directions the hidden states actually use get the rank budget.

An optional distillation (``train_scorer``) then fine-tunes A and B on the
calibration states so that softmax(A B h) matches softmax(W h).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.propose.heads import rows_of


@dataclass(frozen=True)
class Scorer:
    w_down: np.ndarray  # [R, H]: hidden -> rank-R code
    w_vocab: np.ndarray  # [V, R]: code -> approximate logits

    @property
    def rank(self) -> int:
        return int(self.w_down.shape[0])

    def scores(self, hidden: np.ndarray) -> np.ndarray:
        """Approximate logits [n, V] for hidden states [n, H]."""
        return (hidden @ self.w_down.T) @ self.w_vocab.T


def fit_scorer(lm_head: np.ndarray, rank: int, hidden: np.ndarray | None = None, ridge: float = 1e-3) -> Scorer:
    """Rank-``rank`` scorer for ``lm_head`` [V, H]: plain SVD, or data-aware when ``hidden`` [N, H] is given."""
    w = np.asarray(lm_head, dtype=np.float32)
    v, h = w.shape
    if not 0 < rank <= h:
        raise EdgeSpecError(f"--rank must be between 1 and the drafter's hidden size {h}, got {rank}")
    gram = None
    if v > h:  # W^T W, [H, H], from one float64 copy of W (its transpose is a view: the same product)
        wide = w.astype(np.float64)
        gram = wide.T @ wide
        del wide
    if hidden is None:
        lower = np.eye(h)
    else:
        states = np.asarray(hidden, dtype=np.float64)
        second = states.T @ states / len(states)
        second += ridge * np.trace(second) / h * np.eye(h)  # keep unseen directions invertible
        lower = np.linalg.cholesky(second)
    # right singular vectors of W L = eigenvectors of L^T W^T W L
    m = lower.T @ (gram if gram is not None else w.T.astype(np.float64) @ w) @ lower
    eigvals, eigvecs = np.linalg.eigh(m)
    top = eigvecs[:, np.argsort(eigvals)[::-1][:rank]]  # [H, R]
    w_down = np.linalg.solve(lower.T, top).T  # V_r^T L^-1, [R, H]
    w_vocab = w @ (lower @ top).astype(np.float32)  # W L V_r, [V, R]
    return Scorer(w_down.astype(np.float32), w_vocab.astype(np.float32))


def train_scorer(
    scorer: Scorer,
    lm_head: np.ndarray,
    hidden: np.ndarray,
    steps: int,
    *,
    batch: int = 128,
    lr: float = 1e-3,
    temperature: float = 1.0,
    seed: int = 0,
    progress=None,
) -> Scorer:
    """Distil the scorer on calibration states: minimise KL(softmax(W h / T) || softmax(A B h / T)).

    Runs on CPU with torch; a few hundred steps take minutes for a 150k vocabulary.
    """
    import torch

    if steps <= 0:
        return scorer
    gen = torch.Generator().manual_seed(seed)
    head = torch.from_numpy(np.asarray(lm_head, np.float32))
    states = torch.from_numpy(np.asarray(hidden, np.float32))
    down = torch.nn.Parameter(torch.from_numpy(scorer.w_down.copy()))
    vocab = torch.nn.Parameter(torch.from_numpy(scorer.w_vocab.copy()))
    optimizer = torch.optim.Adam([down, vocab], lr=lr)
    for step in range(steps):
        rows = states[torch.randint(len(states), (min(batch, len(states)),), generator=gen)]
        with torch.no_grad():
            teacher = torch.log_softmax(rows @ head.T / temperature, dim=-1)
        student = torch.log_softmax((rows @ down.T) @ vocab.T / temperature, dim=-1)
        loss = torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if progress and (step + 1) % max(steps // 10, 1) == 0:
            progress(f"SpecVocab distillation {step + 1}/{steps}: KL {loss.item():.3f}")
    return Scorer(down.detach().numpy().copy(), vocab.detach().numpy().copy())


def top_candidates(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` highest scores (unordered)."""
    if k >= scores.size:
        return np.arange(scores.size)
    return np.argpartition(scores, scores.size - k)[scores.size - k :]


def recall_at_k(
    scorer: Scorer,
    hidden: np.ndarray,
    wanted: np.ndarray,
    ks: list[int],
    always: np.ndarray | None = None,
    universe: np.ndarray | None = None,
    chunk: int = 256,
) -> dict[int, float]:
    """Share of states whose wanted token (the target's next token, or the drafter's own argmax) is a
    candidate, with candidates picked as the runtime picks them: the top k scores, outside the
    ``always`` ids, plus the ``always`` ids.  ``universe``: the target ids of the scorer's rows
    (None: the whole vocabulary)."""
    wanted = np.asarray(wanted)
    always = np.asarray(always if always is not None else [], np.int64)
    always_rows = rows_of(always, universe)
    hits = {k: 0 for k in ks}
    for start in range(0, len(wanted), chunk):  # [chunk, V] scores at a time: 150k-wide rows are large
        scores = scorer.scores(np.asarray(hidden[start : start + chunk], np.float32))
        scores[:, always_rows] = -np.inf
        for row, token in zip(scores, wanted[start : start + chunk]):
            for k in ks:
                top = top_candidates(row, k)
                ids = top if universe is None else universe[top]
                hits[k] += bool(np.isin(token, ids) or np.isin(token, always))
    return {k: hits[k] / len(wanted) if len(wanted) else 0.0 for k in ks}


def collect_hidden_states(
    body_path: Path, sequences: list[tuple[list[int], list[int]]], capacity: int, threads: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The drafter body's final hidden state before each target-generated token, and that token.

    Returns ``hidden`` [N, H] and ``next_tokens`` [N] over all calibration sequences.
    """
    from edge_spec.runtime.model.decoder import Decoder

    body = Decoder(body_path, threads=threads, capacity=capacity)
    hidden, targets = [], []
    for prompt, generated in sequences:
        if not generated:
            continue
        ids = (prompt + generated)[:-1]
        body.reset()
        hidden.append(body.forward(ids, len(generated))["hidden_states"])
        targets.extend(generated)
    if not hidden:
        raise EdgeSpecError("SpecVocab calibration produced no generated tokens")
    return np.concatenate(hidden).astype(np.float32), np.asarray(targets, np.int64)


def quantize_rows_int8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row absmax int8 (one scale per row), the layout the runtime gathers candidate rows from;
    a band of rows at a time (each row on its own: the same result), so that the float temporaries
    are a band's, not several copies of a vocabulary-sized head."""
    from edge_spec.export.graph.weights import row_bands

    codes = np.empty(weight.shape, np.int8)
    scales = np.empty(weight.shape[0], np.float32)
    for start, w in row_bands(weight, 16 << 20):
        stop = start + len(w)
        band = np.abs(w).max(axis=1) / 127.0
        band[band == 0] = 1.0
        codes[start:stop] = np.clip(np.rint(w / band[:, None]), -127, 127).astype(np.int8)
        scales[start:stop] = band
    return codes, scales
