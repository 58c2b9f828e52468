"""The EAGLE-3 head as a proposer: one decoder layer that reads the target's own hidden states.

Where the drafter model reads tokens only, this head reads what the target already computed: the
residual stream after three of its layers (``features``), projected to one hidden state (``fc``).
Pair t of its input is (embedding of token t+1, fused feature of position t): from it the head
predicts token t+2.  So after the target has read positions 0..m-1 and token m is pending, the head
catches up on the pairs it has not read (one pass over several rows), and its last row proposes the
first draft; every later draft feeds (embedding of the previous draft, the head's own output
hidden state), as EAGLE does.

Only pairs built from the target's features are kept between rounds: the rows a round drafted from
the head's own hidden states are cut before the next catch-up.  The features of each verify pass's
kept positions arrive through :meth:`observe`.  The embedding is the target's, never a copy.

The layer graph ends at the final-normed hidden state; an LM head over the draft vocabulary turns it
into logits (``lm_head``: a :class:`~edge_spec.runtime.propose.heads.DraftHead` - full or VocabTrim -
or a :class:`~edge_spec.runtime.propose.heads.SpecVocabHead`), switchable like the drafter model's.
A bundle made before the split has one graph that outputs ``logits`` itself (``lm_head`` None).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.propose.heads import DraftHead, SpecVocabHead
from edge_spec.runtime.propose.model import ChainDrafter


class EagleDrafter(ChainDrafter):
    """The EAGLE-3 head as a proposer (see :mod:`propose.base`); its name is its registry entry's
    (``propose.drafters``)."""

    def __init__(
        self,
        head: Decoder,
        fc: ort.InferenceSession,
        embed: Callable[[list[int]], np.ndarray],
        draft_ids: np.ndarray,
        vocab_size: int,
        lm_head: DraftHead | SpecVocabHead | None = None,
        *,
        name: str,
    ) -> None:
        super().__init__(vocab_size)
        self.name = name  # its drafts' source
        self.head = head  # the layer graph and its one-layer KV cache; its tokens are each pair's token
        self.fc = fc
        self.embed = embed  # target ids -> rows of the target's embedding
        self.draft_ids = draft_ids  # target id of each draft-vocabulary row (d + d2t[d])
        self.lm_head = lm_head  # None: the layer graph outputs the draft vocabulary's logits itself
        self.feature_tokens: list[int] = []  # the target positions whose fused features are known
        self.fused = np.zeros((head.capacity, self._hidden_size()), np.float32)
        self.true_pairs = 0  # head cache rows built from the target's features (the rest are drafts)
        self.seconds = 0.0
        self._hidden: np.ndarray | None = None  # the head's last output hidden state

    def covered(self, prompt_ids: list[int]) -> int:
        """How many leading prompt positions already have features: the target must not reuse more of
        its cache than this, or the head would miss the features of the rest."""
        limit = min(len(self.feature_tokens), len(prompt_ids))
        common = 0
        while common < limit and self.feature_tokens[common] == prompt_ids[common]:
            common += 1
        return common

    def begin(self, prompt_ids: list[int], outputs: dict[str, np.ndarray]) -> None:
        features = outputs["features"]  # the positions the target's prefill computed: the prompt's tail
        self._keep(len(prompt_ids) - len(features))
        self._add(prompt_ids[len(self.feature_tokens) :], features)

    def observe(self, tokens: list[int], outputs: dict[str, np.ndarray], accepted: int) -> None:
        self._add(tokens, outputs["features"][: len(tokens)])

    def rewind(self, length: int) -> None:
        self._keep(length)

    def start(self, committed: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
        pending = len(committed) - 1
        if len(self.feature_tokens) < pending:
            raise RuntimeError(f"the EAGLE head has features of {len(self.feature_tokens)} positions, needs {pending}")
        self.head.rewind(min(self.head.length, self.true_pairs))
        feed = self.head.sync(committed[1 : pending + 1])  # pair t carries token t + 1
        first = pending - len(feed)
        logits, ids = self._run(feed, self.embed(feed), self.fused[first:pending])
        self.true_pairs = pending
        return logits, ids, len(feed)

    def step(self, token: int) -> tuple[np.ndarray, np.ndarray]:
        return self._run([token], self.embed([token]), self._hidden[None])

    @property
    def decoder(self) -> Decoder:
        return self.head

    @property
    def head_seconds(self) -> float:
        """The LM head's time (a single-graph head's: all of it)."""
        return self.seconds if self.lm_head is None else self.lm_head.seconds

    def profile_fill(self, length: int) -> None:
        self.head.reset()
        self.true_pairs = 0
        if length:
            self._run([0] * length, self.embed([0] * length), np.zeros((length, self.fused.shape[1]), np.float32))

    def profile_step(self, rows: int = 1) -> tuple[float, float]:
        """(layer, LM head) seconds of one step over ``rows`` positions; a single-graph head's all count as head."""
        length = self.head.length
        layer_before, head_before = self.seconds, self.head_seconds
        self._run([0] * rows, self.embed([0] * rows), np.zeros((rows, self.fused.shape[1]), np.float32))
        self.head.rewind(length)
        head = self.head_seconds - head_before
        if self.lm_head is None:
            return 0.0, head
        return self.seconds - layer_before, head

    def _run(self, tokens: list[int], embeds: np.ndarray, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One layer pass, then the LM head on its last row: (logits, target ids of their rows)."""
        started = time.perf_counter()
        out = self.head.forward(
            tokens,
            1,
            inputs={
                "inputs_embeds": embeds.astype(np.float32, copy=False),
                "hidden": np.ascontiguousarray(hidden, np.float32),
            },
        )
        self.seconds += time.perf_counter() - started
        self._hidden = out["hidden_out"][-1]
        if self.lm_head is None:
            return out["logits"][-1], self.draft_ids
        return self.lm_head(out["hidden_states"][-1])

    def _add(self, tokens: list[int], features: np.ndarray) -> None:
        start = len(self.feature_tokens)
        fused = self.fc.run(None, {"features": features[None].astype(np.float32, copy=False)})[0][0]
        self.fused[start : start + len(tokens)] = fused
        self.feature_tokens.extend(tokens)

    def _keep(self, length: int) -> None:
        del self.feature_tokens[length:]
        self.true_pairs = min(self.true_pairs, max(length - 1, 0))

    def _hidden_size(self) -> int:
        return int(self.fc.get_outputs()[0].shape[-1])
