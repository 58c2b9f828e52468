"""Train an EAGLE-3 head on collected target features (:mod:`edge_spec.train.features`), on CPU.

* **Draft vocabulary**: the ``K`` most frequent labels of the training shards (ties by id, as
  VocabTrim) plus the end-of-turn ids; ``d2t`` / ``t2d`` accordingly.
* **Frozen parts**: the target's embedding (rows read with
  :class:`~edge_spec.runtime.model.embedding.TargetEmbedding`; never stored in the head) and the
  target features.  The head's ``lm_head`` starts as the target's LM-head rows of the draft
  vocabulary and its ``norm`` as the target's final norm (EAGLE's choice: the head then only has to
  produce a state the target's own head reads); the LM head stays frozen unless ``train_lm_head``.
* **Loss**: cross-entropy against the target's own next-token distribution restricted to the draft
  vocabulary, recomputed from the stored final hidden state through those LM-head rows (soft
  teacher).  A label outside the draft vocabulary still has a well-defined restricted teacher, so
  every labelled row is trained on; in acceptance such a row counts as a miss.  With
  ``soft=False``: cross-entropy on the greedy label, rows whose label is outside the vocabulary
  excluded.
* **Training-time test** (EAGLE-3, as SpecForge): ``ttt`` unrolled steps; step ``k`` feeds the head
  its own ``out_hidden`` of step ``k - 1`` with the embedding of the token ``k`` further on, at
  rotary position ``t + k``; its query attends to the real positions ``<= t`` of step 0 and to its
  own earlier steps at the same position (the diagonal), as a drafted chain does at run time.
  Step ``k``'s loss is weighted ``0.8 ** k``.
* **Schedule**: AdamW, linear warm-up then cosine to 10%, gradient clipping; fixed seed, data order
  a seeded permutation per epoch; ``accum`` sequences per optimizer step.
* **Checkpoints** (head, optimizer, RNG, step, metrics) every few minutes and at the end, written
  atomically; resuming continues bit for bit (same thread count).
* **Evaluation** on the held-out items: step-1 acceptance (the head's argmax equals the target's
  greedy token), step-2 acceptance (teacher-forced: the true first token fed) and step 2 given step
  1 right (what a drafted chain sees), at training-token milestones (on a fixed subset of the
  held-out rows) and at the end of a run (all of them) -> ``curve.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edge_spec.errors import EdgeSpecError
from edge_spec.export.eagle.model import Eagle3Config, Eagle3Head
from edge_spec.train.settings import CHECKPOINT_SECONDS, TrainOptions

CHECKPOINT = "checkpoint.pt"
CURVE = "curve.json"
MILESTONES = (5_000, 10_000, 25_000, 50_000, 100_000, 200_000, 400_000, 800_000, 1_600_000, 3_200_000)


# -- data ----------------------------------------------------------------------------------------


@dataclass
class Sequence:
    features: torch.Tensor  # fp16 [T, 3H]
    tokens: torch.Tensor  # int64 [T]: compact embedding-table indices of x_{t+1}
    labels: torch.Tensor  # int64 [T]: target ids, -1 where unlabelled
    hidden: torch.Tensor | None  # fp16 [T, H] teacher hidden states (None: hard labels only)

    @property
    def labelled(self) -> int:
        return int((self.labels >= 0).sum())


@dataclass
class Dataset:
    train: list[Sequence]
    held_out: list[Sequence]
    token_ids: np.ndarray  # target ids of the compact embedding table's rows
    label_counts: np.ndarray  # [V] how often each id is a training label
    train_tokens: int  # labelled training rows
    held_out_tokens: int
    shards: list[str]  # training shard names, in order (a resume checks they are the same)


def _cut(arrays: dict, seq_len: int, soft: bool) -> list[dict]:
    """Pieces of at most ``seq_len`` rows of one item, each with at least one labelled row."""
    n = len(arrays["tokens"])
    out = []
    for start in range(0, n, seq_len):
        piece = {k: arrays[k][start : start + seq_len] for k in ("features", "tokens", "labels")}
        piece["hidden"] = arrays["hidden"][start : start + seq_len] if soft and "hidden" in arrays else None
        if (piece["labels"] >= 0).any():
            out.append(piece)
    return out


def load_dataset(work_dir, vocab_size: int, options: TrainOptions) -> Dataset:
    from edge_spec.train.features import SHARDS, read_progress

    work_dir = Path(work_dir)
    progress = read_progress(work_dir)
    records = sorted(progress["items"].values(), key=lambda r: r["shard"])
    pieces: dict[str, list[dict]] = {"train": [], "held_out": []}
    counts = np.zeros(vocab_size, np.int64)
    names = []
    for record in records:
        with np.load(work_dir / SHARDS / record["shard"]) as data:
            arrays = {k: data[k] for k in data.files}
        if record["split"] == "train":
            names.append(record["shard"])
            labels = arrays["labels"]
            np.add.at(counts, labels[labels >= 0].astype(np.int64), 1)
        pieces[record["split"]] += _cut(arrays, options.seq_len, options.soft)
    if not pieces["train"]:
        raise EdgeSpecError(f"no training items collected in {work_dir}")
    if not pieces["held_out"]:
        raise EdgeSpecError(f"no held-out items collected in {work_dir} (collect more items)")
    token_ids = np.unique(np.concatenate([p["tokens"] for split in pieces.values() for p in split]))
    index = {int(t): i for i, t in enumerate(token_ids)}
    lookup = np.vectorize(index.__getitem__, otypes=[np.int64])

    def seq(piece: dict) -> Sequence:
        hidden = None if piece["hidden"] is None else torch.from_numpy(np.ascontiguousarray(piece["hidden"]))
        return Sequence(
            torch.from_numpy(np.ascontiguousarray(piece["features"])),
            torch.from_numpy(lookup(piece["tokens"])),
            torch.from_numpy(piece["labels"].astype(np.int64)),
            hidden,
        )

    train = [seq(p) for p in pieces["train"]]
    held_out = [seq(p) for p in pieces["held_out"]]
    return Dataset(
        train, held_out, token_ids, counts, sum(s.labelled for s in train), sum(s.labelled for s in held_out), names
    )


def draft_vocabulary(counts: np.ndarray, size: int, always: list[int]) -> np.ndarray:
    """Sorted target ids of the draft vocabulary: the ``size`` most frequent labels (+ ``always``)."""
    from edge_spec.export.heads.vocabtrim import select_vocabulary

    return select_vocabulary(counts, min(size, counts.size), always)


# -- model ---------------------------------------------------------------------------------------


@dataclass
class Target:
    """What the trainer needs of the target: sizes, embedding rows, LM-head rows, final norm."""

    config: dict  # the manifest's target config
    feature_layers: tuple[int, ...]
    eos_ids: list[int]
    graph: Path

    @classmethod
    def from_work(cls, bundle_dir, work_dir) -> Target:
        from edge_spec.export.eagle.model import feature_layers_of
        from edge_spec.manifest import read_manifest
        from edge_spec.train.features import read_progress

        manifest = read_manifest(Path(bundle_dir))
        graph = Path(work_dir) / "target" / "model.onnx"
        layers = tuple(read_progress(work_dir)["settings"]["feature_layers"])
        if graph.is_file() and feature_layers_of(graph) != layers:
            raise EdgeSpecError(f"{graph} does not output the features the shards hold")
        tok = json.loads((Path(bundle_dir) / "tokenizer_config.json").read_text())
        eos = sorted(set(tok.get("eos_token_ids") or []))
        return cls(manifest["target"]["config"], layers, eos, graph)

    def head_config(self, draft_vocab: int, intermediate: int) -> Eagle3Config:
        c = self.config
        return Eagle3Config(
            hidden_size=c["hidden_size"],
            intermediate_size=intermediate,
            num_attention_heads=c["num_heads"],
            num_key_value_heads=c["num_kv_heads"],
            head_dim=c["head_dim"],
            rms_norm_eps=c["rms_norm_eps"],
            rope_theta=c["rope_theta"],
            vocab_size=c["vocab_size"],
            draft_vocab_size=draft_vocab,
            feature_layers=self.feature_layers,
            max_position_embeddings=c["max_position_embeddings"],
        )


def new_head(
    config: Eagle3Config, vocab_ids: np.ndarray, lm_rows: np.ndarray, final_norm: np.ndarray, seed: int
) -> Eagle3Head:
    """A freshly initialised head (seeded) with the vocabulary maps, LM head and norm set."""
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    ids = torch.from_numpy(np.asarray(vocab_ids, np.int64))
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(len(ids)))
        head.t2d.zero_()
        head.t2d[ids] = True
        head.lm_head.weight.copy_(torch.from_numpy(np.asarray(lm_rows, np.float32)))
        head.norm.weight.copy_(torch.from_numpy(np.asarray(final_norm, np.float32)))
    return head


def initial_head(source: str, target: Target) -> Eagle3Head:
    """The head ``--init`` names, checked against the target and the collected features."""
    from edge_spec.train.saved import load_head

    config, head = load_head(source)
    c = target.config
    if (config.hidden_size, config.vocab_size) != (c["hidden_size"], c["vocab_size"]):
        raise EdgeSpecError(
            f"--init {source}: a head for hidden size {config.hidden_size} and vocabulary "
            f"{config.vocab_size}, not this target's {c['hidden_size']} / {c['vocab_size']}"
        )
    if tuple(config.feature_layers or ()) != tuple(target.feature_layers):
        raise EdgeSpecError(
            f"--init {source}: the head reads target layers {config.feature_layers}, the collected "
            f"features are layers {tuple(target.feature_layers)} (collect with --feature-layers "
            f"{','.join(map(str, config.feature_layers or ()))})"
        )
    return head.train()


def _attend(attn, x: torch.Tensor, positions: torch.Tensor, cache: list) -> torch.Tensor:
    """The head's attention for one training-time-test step (see module docstring); ``cache``
    collects each step's keys / values (after rotary)."""
    cfg = attn.cfg
    t = x.shape[1]
    q, k, v = attn.project(x, positions)
    cache.append((k, v))
    if len(cache) == 1:
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        scale = 1.0 / math.sqrt(cfg.head_dim)
        k0, v0 = cache[0]
        scores = torch.matmul(q, k0.transpose(-1, -2)) * scale
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        diagonal = torch.stack([(q * kj).sum(-1) * scale for kj, _ in cache[1:]], dim=-1)  # [b, h, t, steps]
        weights = torch.softmax(torch.cat([scores, diagonal], dim=-1), dim=-1)
        out = torch.matmul(weights[..., :t], v0)
        for j, (_, vj) in enumerate(cache[1:]):
            out = out + weights[..., t + j, None] * vj
    return attn.output(out)


def unrolled(head: Eagle3Head, features: torch.Tensor, embeds: torch.Tensor, steps: int):
    """Training-time test: ``features`` [T, 3H], ``embeds`` [T + steps - 1, H] (embedding of
    x_{t+1} at row t, continued) -> list of draft logits [T, K] per step (step k at row t predicts
    the label of row t + k)."""
    t = features.shape[0]
    m = head.midlayer
    hidden = head.fuse(features)[None]
    cache: list = []
    outputs = []
    for k in range(steps):
        emb = embeds[k : k + t][None]
        positions = (torch.arange(t) + k)[None]
        joined = torch.cat((m.input_layernorm(emb), m.hidden_norm(hidden)), dim=-1)
        h = hidden + _attend(m.self_attn, joined, positions, cache)
        hidden = h + m.mlp(m.post_attention_layernorm(h))
        outputs.append(head.lm_head(head.norm(hidden))[0])
    return outputs


class Trainer:
    """State of one training run: data, head, optimizer, step; checkpointable."""

    def __init__(self, work_dir, target: Target, options: TrainOptions, log: Callable[[str], None] | None = None):
        from edge_spec.runtime.model.embedding import TargetEmbedding, TargetLMHead, read_initializer

        options.check()
        self.dir = Path(work_dir) / "train"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.options = options
        self.log = log or (lambda message: None)
        vocab = int(target.config["vocab_size"])
        self.data = load_dataset(work_dir, vocab, options)
        if options.soft and self.data.train[0].hidden is None:
            raise EdgeSpecError("the shards hold no teacher hidden states; train with soft=False")
        start = initial_head(options.init, target) if options.init else None
        if start is not None:
            self.config = start.config
            self.vocab_ids = start.draft_to_target(np.arange(self.config.draft_vocab_size))
        else:
            self.vocab_ids = draft_vocabulary(self.data.label_counts, options.draft_vocab, target.eos_ids)
            self.config = target.head_config(len(self.vocab_ids), options.intermediate)
        lm_rows = TargetLMHead.from_onnx(target.graph).rows(self.vocab_ids)
        final_norm = np.array(read_initializer(target.graph, "final_norm"), np.float32)
        self.embedding = torch.from_numpy(TargetEmbedding.from_onnx(target.graph).rows(self.data.token_ids))
        self.teacher_rows = torch.from_numpy(lm_rows)  # [K, H] fp32: the target's logits over the draft vocabulary
        self.to_draft = torch.full((vocab,), -1, dtype=torch.int64)
        self.to_draft[torch.from_numpy(self.vocab_ids)] = torch.arange(len(self.vocab_ids))
        self.head = new_head(self.config, self.vocab_ids, lm_rows, final_norm, options.seed)
        if start is not None:  # its weights; the LM head stays the target's own rows, as in a fresh head
            self.head.load_state_dict({**start.state_dict(), "lm_head.weight": self.head.lm_head.weight.detach()})
        self.head.lm_head.weight.requires_grad_(options.train_lm_head)
        self.params = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=options.lr, weight_decay=options.weight_decay, betas=(0.9, 0.95)
        )
        n = len(self.data.train)
        self.total_steps = options.steps or max(1, math.ceil(options.epochs * n / options.accum))
        self.step = 0
        self.tokens_seen = 0
        self.seconds = 0.0
        self.curve: list[dict] = []
        self.eval_set = self._eval_subset()

    # -- bookkeeping ---------------------------------------------------------------------------

    def _eval_subset(self) -> list[Sequence]:
        chosen, rows = [], 0
        for seq in self.data.held_out:
            if rows >= self.options.eval_rows:
                break
            chosen.append(seq)
            rows += seq.labelled
        return chosen

    def lr_at(self, step: int) -> float:
        o = self.options
        warm = min(o.warmup, max(self.total_steps // 10, 1))
        if step < warm:
            return o.lr * (step + 1) / warm
        progress = (step - warm) / max(self.total_steps - warm, 1)
        return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    def sequence_at(self, position: int) -> Sequence:
        """The ``position``-th training sequence of the seeded stream (a permutation per epoch)."""
        n = len(self.data.train)
        epoch, index = divmod(position, n)
        order = np.random.default_rng([self.options.seed, epoch]).permutation(n)
        return self.data.train[int(order[index])]

    # -- one sequence --------------------------------------------------------------------------

    def _embeds(self, seq: Sequence, steps: int) -> torch.Tensor:
        idx = seq.tokens
        if steps > 1:  # rows past the end (masked out) repeat the last token
            idx = torch.cat([idx, idx[-1:].expand(steps - 1)])
        return self.embedding[idx]

    def _losses(self, seq: Sequence, steps: int, soft: bool):
        """Per-step (loss, metrics) of one sequence."""
        t = len(seq.labels)
        logits = unrolled(self.head, seq.features.float(), self._embeds(seq, steps), steps)
        teacher = None
        if soft and seq.hidden is not None:
            with torch.no_grad():
                teacher = torch.softmax(seq.hidden.float() @ self.teacher_rows.T, dim=-1)  # [T, K]
        out = []
        for k, step_logits in enumerate(logits):
            rows = torch.arange(t - k)
            labels = seq.labels[k:]
            valid = labels >= 0
            logp = torch.log_softmax(step_logits[rows], dim=-1)
            if teacher is not None:
                loss_rows = -(teacher[k:] * logp).sum(-1)
                loss_mask = valid
            else:
                target = self.to_draft[labels.clamp(min=0)]
                loss_mask = valid & (target >= 0)
                loss_rows = -logp.gather(-1, target.clamp(min=0)[:, None])[:, 0]
            denominator = loss_mask.sum().clamp(min=1)
            loss = (loss_rows * loss_mask).sum() / denominator
            predicted = self.vocab_ids_t[step_logits[rows].argmax(-1)]
            hits = (predicted == labels) & valid
            out.append((loss, loss_mask.sum(), valid, hits))
        return out

    @property
    def vocab_ids_t(self) -> torch.Tensor:
        if not hasattr(self, "_vocab_ids_t"):
            self._vocab_ids_t = torch.from_numpy(self.vocab_ids.astype(np.int64))
        return self._vocab_ids_t

    def train_step(self) -> float:
        o = self.options
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(o.accum):
            seq = self.sequence_at(self.step * o.accum + j)
            losses = self._losses(seq, o.ttt, o.soft)
            loss = sum((o.ttt_decay**k) * step_loss for k, (step_loss, _, _, _) in enumerate(losses)) / o.accum
            loss.backward()
            total += float(loss.detach())
            self.tokens_seen += seq.labelled
        if o.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, o.grad_clip)
        self.optimizer.step()
        self.step += 1
        return total

    @torch.no_grad()
    def evaluate(self, sequences: list[Sequence] | None = None) -> dict:
        """Held-out acceptance at steps 1 and 2 and the step-1 loss (soft teacher when available)."""
        sequences = self.eval_set if sequences is None else sequences
        hits1 = rows1 = hits2 = rows2 = both = first_ok = 0
        loss_sum = loss_rows = 0.0
        for seq in sequences:
            (l1, n1, v1, h1), (_, _, v2, h2) = self._losses(seq, 2, self.options.soft)
            rows1 += int(v1.sum())
            hits1 += int(h1.sum())
            rows2 += int(v2.sum())
            hits2 += int(h2.sum())
            pair = v1[:-1] & v2 if len(v2) else v2
            if len(v2):
                first = h1[:-1] & pair
                first_ok += int(first.sum())
                both += int((first & h2).sum())
            loss_sum += float(l1) * int(n1)
            loss_rows += int(n1)
        return {
            "acceptance_1": hits1 / max(rows1, 1),
            "acceptance_2": hits2 / max(rows2, 1),
            "acceptance_2_given_1": both / max(first_ok, 1),
            "loss": loss_sum / max(loss_rows, 1),
            "rows": rows1,
        }

    def record(self, evaluation: dict, reason: str) -> dict:
        entry = {
            "step": self.step,
            "tokens": self.tokens_seen,
            "distinct_tokens": min(self.tokens_seen, self.data.train_tokens),
            "epoch": round(self.step * self.options.accum / len(self.data.train), 3),
            "seconds": round(self.seconds, 1),
            "reason": reason,
            **evaluation,
        }
        self.curve.append(entry)
        tmp = self.dir / (CURVE + ".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "train_tokens": self.data.train_tokens,
                    "held_out_tokens": self.data.held_out_tokens,
                    "eval_rows": evaluation.get("rows"),
                    "points": self.curve,
                },
                indent=1,
            )
            + "\n"
        )
        os.replace(tmp, self.dir / CURVE)
        return entry

    # -- checkpoints ---------------------------------------------------------------------------

    def state(self) -> dict:
        return {
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "seconds": self.seconds,
            "curve": self.curve,
            "total_steps": self.total_steps,
            "options": dataclasses.asdict(self.options),
            "vocab_ids": self.vocab_ids,
            "shards": self.data.shards,
            "torch_rng": torch.get_rng_state(),
            "config": self.config.to_hf_config(),
        }

    def save(self) -> Path:
        path = self.dir / CHECKPOINT
        tmp = self.dir / (CHECKPOINT + ".tmp")
        torch.save(self.state(), tmp)
        os.replace(tmp, path)
        return path

    def load(self, path: Path | None = None) -> None:
        path = path or self.dir / CHECKPOINT
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state["shards"] != self.data.shards:
            raise EdgeSpecError(
                f"{path} was trained on other shards than {self.dir.parent} holds now; "
                "train afresh (delete the train directory) or restore the shards"
            )
        if not np.array_equal(state["vocab_ids"], self.vocab_ids):
            raise EdgeSpecError(f"{path}: draft vocabulary differs from the one the shards give")
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.tokens_seen, self.seconds = state["step"], state["tokens_seen"], state["seconds"]
        self.curve, self.total_steps = state["curve"], state["total_steps"]
        torch.set_rng_state(state["torch_rng"])


def checkpoint_options(work_dir) -> TrainOptions | None:
    """The options a checkpoint in ``work_dir`` was trained with (None: no checkpoint)."""
    path = Path(work_dir) / "train" / CHECKPOINT
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    return TrainOptions(**state["options"])


def _start(work_dir, target: Target, options: TrainOptions, resume: bool, extend_steps, log) -> Trainer:
    """The trainer a run starts from: a checkpoint's (``resume``, its options kept and its schedule
    stretched to ``extend_steps``) or a fresh one, evaluated once before its first step."""
    checkpoint = Path(work_dir) / "train" / CHECKPOINT
    if checkpoint.is_file() and not resume:
        raise EdgeSpecError(
            f"{checkpoint} exists: pass --resume to continue that run, or delete {checkpoint.parent} to train afresh"
        )
    if resume and checkpoint.is_file():
        stored = checkpoint_options(work_dir)
        if stored != options:
            log("resuming with the options the checkpoint was trained with")
        options = stored
    trainer = Trainer(work_dir, target, options, log)
    if resume and checkpoint.is_file():
        trainer.load()
        if extend_steps is not None and extend_steps != trainer.total_steps:
            if extend_steps < trainer.step:
                raise EdgeSpecError(f"--steps {extend_steps} is below the {trainer.step} steps already trained")
            log(f"extending the schedule from {trainer.total_steps} to {extend_steps} steps")
            trainer.total_steps = extend_steps
        log(f"resumed at step {trainer.step}/{trainer.total_steps}")
    else:
        log(
            f"draft vocabulary {len(trainer.vocab_ids)} tokens; {trainer.data.train_tokens} training / "
            f"{trainer.data.held_out_tokens} held-out tokens in {len(trainer.data.train)} / "
            f"{len(trainer.data.held_out)} sequences; {trainer.total_steps} steps"
        )
        entry = trainer.record(trainer.evaluate(), "start")
        log(_describe(entry))
    return trainer


def train(
    work_dir,
    target: Target,
    options: TrainOptions,
    *,
    resume: bool = False,
    time_budget: float | None = None,
    checkpoint_seconds: float = CHECKPOINT_SECONDS,
    threads: int = 0,
    log: Callable[[str], None] | None = None,
    stop_after: int | None = None,
    extend_steps: int | None = None,
) -> Trainer:
    """Train (or continue) the head in ``work_dir/train``; returns the trainer at the end.

    ``time_budget``: seconds of training in this run (the final evaluation and checkpoint follow);
    ``stop_after``: stop at this step (tests: simulate an interruption); ``extend_steps`` (with
    ``resume``): continue to this many steps in all, the cosine schedule stretched to the new end
    (a warm restart: the learning rate goes back up to where the longer schedule would be).  A plain
    resume keeps the checkpoint's options and schedule, so it continues bit for bit."""
    if threads:
        torch.set_num_threads(threads)
    log = log or (lambda message: None)
    trainer = _start(work_dir, target, options, resume, extend_steps, log)
    started = time.perf_counter()
    last_save = started
    seconds_before = trainer.seconds
    milestones = [m for m in MILESTONES if m > trainer.tokens_seen]
    end = trainer.total_steps if stop_after is None else min(stop_after, trainer.total_steps)
    last_log = started
    while trainer.step < end:
        if time_budget is not None and time.perf_counter() - started >= time_budget:
            log("time budget reached")
            break
        loss = trainer.train_step()
        now = time.perf_counter()
        trainer.seconds = seconds_before + now - started
        if now - last_log >= 30:
            rate = (trainer.step) / max(trainer.seconds, 1e-9)
            eta = (trainer.total_steps - trainer.step) / max(rate, 1e-9)
            log(
                f"step {trainer.step}/{trainer.total_steps} loss {loss:.3f} lr {trainer.lr_at(trainer.step):.2e} "
                f"tokens {trainer.tokens_seen} elapsed {_clock(trainer.seconds)} eta {_clock(eta)}"
            )
            last_log = now
        if milestones and trainer.tokens_seen >= milestones[0]:
            while milestones and trainer.tokens_seen >= milestones[0]:
                milestones.pop(0)
            log(_describe(trainer.record(trainer.evaluate(), "milestone")))
        if now - last_save >= checkpoint_seconds:
            trainer.save()
            log(f"checkpoint at step {trainer.step}")
            last_save = time.perf_counter()
    if trainer.step > 0 and (not trainer.curve or trainer.curve[-1]["step"] != trainer.step):
        # the last point is evaluated on every held-out row, the milestones on a fixed subset
        log(
            _describe(
                trainer.record(
                    trainer.evaluate(trainer.data.held_out), "end" if trainer.step >= trainer.total_steps else "stop"
                )
            )
        )
    trainer.save()
    return trainer


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _describe(entry: dict) -> str:
    return (
        f"[{entry['reason']}] step {entry['step']} tokens {entry['tokens']}: held-out acceptance "
        f"step 1 {entry['acceptance_1']:.1%}, step 2 {entry['acceptance_2']:.1%} "
        f"(given step 1: {entry['acceptance_2_given_1']:.1%}), loss {entry['loss']:.3f}"
    )


__all__ = [
    "Dataset",
    "Target",
    "TrainOptions",
    "Trainer",
    "checkpoint_options",
    "draft_vocabulary",
    "load_dataset",
    "new_head",
    "train",
    "unrolled",
]
