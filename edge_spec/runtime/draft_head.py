"""A drafter LM head as its own small ORT session: final hidden state -> logits over the head's rows.

Keeping heads outside the drafter body lets one bundle carry several heads
(full vocabulary, VocabTrim at several K) over one body, and is where SpecVocab's
per-step candidate heads plug in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.providers import resolve_provider


class DraftHead:
    """``logits = head(hidden)``; ``vocab_ids[j]`` is the target id of head row j (None: identity)."""

    def __init__(self, model_path: Path, *, provider: str = "cpu", threads: int = 0,
                 vocab_ids: np.ndarray | None = None) -> None:
        if not Path(model_path).is_file():
            raise EdgeSpecError(f"drafter head not found: {model_path}")
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # see Decoder
        self.session = ort.InferenceSession(str(model_path), opts, providers=resolve_provider(provider))
        self.rows = int(self.session.get_outputs()[0].shape[-1])
        if vocab_ids is not None and len(vocab_ids) != self.rows:
            raise EdgeSpecError(f"{model_path}: head has {self.rows} rows but its vocabulary map {len(vocab_ids)}")
        self.vocab_ids = vocab_ids

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [n, H] -> logits [n, rows]."""
        return self.session.run(None, {"hidden_states": hidden[None]})[0][0]
