"""VocabTrim: keep only the drafter LM-head rows of tokens the target actually produces.

Why: the 0.5B drafter's head (151,936 x 896) is ~27% of the weights each draft
step reads, yet the target emits a few thousand distinct tokens in practice.
The VocabTrim paper (arXiv 2506.22694) finds calibration on **target-generated**
text best, so we run the freshly exported target on a calibration prompt set
and count the tokens it generates.  The same sequences calibrate SpecVocab's
scorer (``specvocab.py``).

Ranking: calibration count first; ties (including the long tail never seen in
calibration) are broken by token id, which for byte-level BPE vocabularies
follows merge order, i.e. corpus frequency.  End-of-turn and special tokens are
always kept so a trimmed drafter can still propose the end of an answer.
Tokens outside the kept set get q = 0, which verification handles exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.paths import PACKAGE_DATA

DEFAULT_CALIBRATION = PACKAGE_DATA / "calibration" / "prompts.jsonl"


def load_prompts(path: Path | None) -> list[str]:
    """Prompts from a .jsonl file (``{"prompt": ...}`` per line), a JSON list, or plain text (one per line)."""
    path = Path(path) if path else DEFAULT_CALIBRATION
    if not path.is_file():
        raise EdgeSpecError(f"calibration file not found: {path}")
    text = path.read_text()
    if path.suffix == ".jsonl":
        prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    elif path.suffix == ".json":
        prompts = [p if isinstance(p, str) else p["prompt"] for p in json.loads(text)]
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise EdgeSpecError(f"calibration file has no prompts: {path}")
    return prompts


def generate_calibration(
    bundle_dir: Path, prompts: list[str], new_tokens: int, context_length: int, progress=None, threads: int = 0
) -> list[tuple[list[int], list[int]]]:
    """Greedy-generate up to ``new_tokens`` per prompt with the exported target (stopping at EOS).

    Returns ``(prompt_ids, generated_ids)`` per prompt: VocabTrim counts the
    generated ids, SpecVocab fits its scorer on the drafter's hidden states over them.
    """
    from edge_spec.runtime.loops.autoregressive import generate_autoregressive
    from edge_spec.runtime.loops.request import Request
    from edge_spec.runtime.model.decoder import Decoder
    from edge_spec.runtime.text import TextTokenizer
    from edge_spec.runtime.verify.sampling import SamplingParams

    tokenizer = TextTokenizer(bundle_dir)
    target = Decoder(bundle_dir / "target" / "model.onnx", threads=threads, capacity=context_length)
    rng = np.random.default_rng(0)
    sequences = []
    distinct: set[int] = set()
    new_tokens = min(new_tokens, context_length // 2)  # a short context keeps half of it for the prompt
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        ids = ids[-(context_length - new_tokens - 1) :]
        generated = []
        for token in generate_autoregressive(Request(target, [], ids, SamplingParams(), rng, new_tokens)):
            if token in tokenizer.eos_token_ids:
                break
            generated.append(token)
        sequences.append((ids, generated))
        distinct.update(generated)
        if progress:
            progress(f"calibration {i + 1}/{len(prompts)}: {len(distinct)} distinct tokens so far")
    return sequences


def count_tokens(sequences: list[tuple[list[int], list[int]]], vocab_size: int) -> np.ndarray:
    """How often the target generated each id over the calibration sequences."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for _, generated in sequences:
        np.add.at(counts, np.asarray(generated, dtype=np.int64), 1)
    return counts


def save_calibration(path: Path, sequences: list[tuple[list[int], list[int]]], key: str = "", source: str = "") -> None:
    """Store calibration sequences in the bundle, so heads can be added later without regenerating;
    ``key``: what made them (``calibration_store.calibration_key``), so that the file can be shipped, and
    ``source`` the GGUF file they came from (``calibration_store.source_key``; "" for another source)."""
    flat = [t for prompt, generated in sequences for t in prompt + generated]
    np.savez(
        path,
        tokens=np.asarray(flat, np.int64),
        prompt_lengths=np.asarray([len(p) for p, _ in sequences], np.int64),
        generated_lengths=np.asarray([len(g) for _, g in sequences], np.int64),
        key=np.asarray(key),
        source=np.asarray(source),
    )


def load_calibration(path: Path) -> list[tuple[list[int], list[int]]]:
    data = np.load(path)
    sequences, offset = [], 0
    for p, g in zip(data["prompt_lengths"].tolist(), data["generated_lengths"].tolist()):
        chunk = data["tokens"][offset : offset + p + g].tolist()
        sequences.append((chunk[:p], chunk[p:]))
        offset += p + g
    return sequences


def select_vocabulary(counts: np.ndarray, keep: int, always_keep: list[int]) -> np.ndarray:
    """The ``keep`` target ids with the highest counts (ties by id), plus ``always_keep``; sorted."""
    vocab = counts.size
    if not 0 < keep <= vocab:
        raise EdgeSpecError(f"--keep must be between 1 and the vocabulary size {vocab}, got {keep}")
    forced = np.unique(np.asarray([i for i in always_keep if 0 <= i < vocab], dtype=np.int64))
    order = np.lexsort((np.arange(vocab), -counts))  # count desc, then id asc
    order = order[~np.isin(order, forced)]
    chosen = np.concatenate([forced, order[: max(keep - forced.size, 0)]])
    return np.sort(chosen).astype(np.int64)
