"""What ``train-head`` collects and trains with, and their defaults: the CLI's options take their defaults
from here, so a default is written once.

Kept free of the trainer's heavy imports (torch, onnx): the CLI reads it to build its help.
:mod:`train.features` and :mod:`train.trainer` use these settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_spec.errors import EdgeSpecError

CHECKPOINT_SECONDS = 300.0  # between two training checkpoints


@dataclass(frozen=True)
class CollectOptions:
    """How target features are collected (:func:`train.features.collect`)."""

    answer_tokens: int = 256  # most tokens the target generates per prompt
    window: int = 512  # most tokens per text window (one pass)
    min_window: int = 32  # shorter text windows (file tails) are dropped, unless the whole file is that short
    held_out_every: int = 10  # every n-th prompt / text file is held out
    max_items: int | None = None  # stop after this many items (in collection order)
    threads: int = 0
    seed: int = 0  # order of the text files
    time_budget: float | None = None  # seconds: start no new item after this long

    def check(self) -> None:
        if self.answer_tokens < 2:
            raise EdgeSpecError("--max-tokens must be at least 2")
        if not 16 <= self.window <= 4096:
            raise EdgeSpecError("text windows must be between 16 and 4096 tokens")
        if self.held_out_every < 2:
            raise EdgeSpecError("held_out_every must be at least 2")
        if self.max_items is not None and self.max_items < 1:
            raise EdgeSpecError("--max-items must be at least 1")


@dataclass(frozen=True)
class TrainOptions:
    """How the head is trained (:func:`train.trainer.train`); a checkpoint keeps them, so a resumed
    run trains as the run it continues."""

    draft_vocab: int = 16384
    intermediate: int = 4480
    epochs: float = 2.0
    steps: int | None = None  # optimizer steps; default: epochs x training sequences / accum
    accum: int = 1  # sequences per optimizer step
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup: int = 40
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt: int = 2  # unrolled training-time-test steps (1 = plain teacher forcing)
    ttt_decay: float = 0.8
    seq_len: int = 1024  # most rows per training sequence (longer items are cut into pieces)
    soft: bool = True  # soft teacher (target distribution) when the shards hold hidden states
    train_lm_head: bool = False
    seed: int = 0
    eval_rows: int = 4000  # labelled held-out rows evaluated at milestones (a fixed prefix of the held-out
    # items; the last point of a run uses them all)
    init: str | None = None  # a head to start from (saved-head directory, SpecForge checkpoint or hub id):
    # its weights, draft vocabulary and MLP width replace a fresh head's

    def check(self) -> None:
        if self.draft_vocab < 2:
            raise EdgeSpecError("--vocab-size must be at least 2")
        if self.intermediate < 1:
            raise EdgeSpecError("--intermediate must be positive")
        if self.steps is not None and self.steps < 1:
            raise EdgeSpecError("--steps must be at least 1")
        if self.epochs <= 0:
            raise EdgeSpecError("--epochs must be positive")
        if not 1 <= self.ttt <= 8:
            raise EdgeSpecError("--ttt must be between 1 and 8")
        if self.accum < 1 or self.seq_len < 8:
            raise EdgeSpecError("accum must be >= 1 and seq_len >= 8")


__all__ = ["CHECKPOINT_SECONDS", "CollectOptions", "TrainOptions"]
