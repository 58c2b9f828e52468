"""Attach a GGUF file's quantized blocks to the weights transformers loaded from it, so the graph builder
carries them into ``MatMulNBits`` instead of re-quantizing the dequantized floats (see gguf/blocks.py).

Every carried matrix is checked against the float weight transformers produced for the same name (its
GGUF loader dequantizes, and for Llama-family files undoes llama.cpp's Q/K row permutation): a matrix is
carried only if the blocks reproduce that weight, so a name mapping or permutation this module does not
know falls back to re-quantization instead of exporting a wrong model.  What fell back, and why, is
returned for the export summary and the bundle manifest.

:class:`GGUFBlocks` makes that check once, when first asked, one matrix at a time, and keeps only what
it decided: each matrix's blocks are read from the file again when the graph builder asks for them,
so the carried model (an int4 model's size) is never held whole either.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge_spec.export.gguf.blocks import CarriedBlocks, carry_gguf
from edge_spec.export.graph.weights import DecoderWeights, DeferredMatrix

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
#: GGUF tensor name (per layer) -> the LayerWeights fields it holds, in row order
_LAYER_PARTS = {
    "attn_q": ("q",),
    "attn_k": ("k",),
    "attn_v": ("v",),
    "attn_output": ("o",),
    "attn_qkv": ("q", "k", "v"),
    "ffn_gate": ("gate",),
    "ffn_up": ("up",),
    "ffn_down": ("down",),
}


@dataclass
class CarryReport:
    carried: Counter = field(default_factory=Counter)  # GGUF type -> matrices carried
    fallback: dict[str, str] = field(default_factory=dict)  # weight name -> why it was re-quantized

    def summary(self) -> str:
        """One line for the export log."""
        total = sum(self.carried.values())
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.carried.items()))
        line = f"GGUF blocks carried: {total} matrices ({kinds or 'none'})"
        if self.fallback:
            shown = "; ".join(f"{name} ({why})" for name, why in list(self.fallback.items())[:4])
            more = f" and {len(self.fallback) - 4} more" if len(self.fallback) > 4 else ""
            line += f"; re-quantized: {shown}{more}"
        return line

    def to_dict(self) -> dict:
        return {"carried": dict(sorted(self.carried.items())), "requantized": dict(self.fallback)}


def _llama_unpermute(rows: int, heads: int) -> np.ndarray:
    """Row order transformers' GGUF loader restores for a Llama q/k weight (llama.cpp interleaves the
    rotary halves of each head); returned as indices into the GGUF rows."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(1, 2).reshape(-1)


#: rows compared per matrix, spread over it from its first row to its last, every column of each.  What the
#: check guards against is systematic: another tensor under a name, a row order (Llama's q/k interleave),
#: a block layout decoded wrongly; each shows in nearly every row, so a spread of rows finds it, at a
#: fraction of the cost of decoding a 1.5B model twice and comparing every weight (a minute on a laptop)
CHECKED_ROWS = 512


def _checked_rows(n: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(n, CHECKED_ROWS)).astype(np.int64))


def _close(carried: np.ndarray, reference: np.ndarray) -> bool:
    atol = 1e-6 * max(float(np.abs(reference).max(initial=0)), 1e-30)
    return bool(np.allclose(carried, reference, rtol=1e-5, atol=atol))


def _matches(blocks: CarriedBlocks, weight, reference: np.ndarray | None = None) -> bool:
    """Whether ``blocks`` dequantize to ``weight`` on :func:`_checked_rows` (``reference``: those rows of
    ``weight``, read already)."""
    if blocks.n != weight.shape[0] or blocks.k != weight.shape[1]:
        return False
    rows = _checked_rows(blocks.n)
    ref = _take_rows(weight, rows) if reference is None else reference
    return _close(blocks.rows(rows).dequantize(), ref)


def _take_rows(weight, rows: np.ndarray) -> np.ndarray:
    """``weight[rows]`` for sorted ``rows``; a deferred matrix reads those rows only (an embedding-sized
    one is not read whole for a check of a few thousand rows)."""
    return weight.take_rows(rows) if isinstance(weight, DeferredMatrix) else weight[rows]


def _fit_rows(blocks: CarriedBlocks, weight, heads: int | None) -> tuple[bool, np.ndarray | None]:
    """Whether ``blocks`` are ``weight``, and the row order that makes them so: None (as they are) or
    Llama's q/k order undone (see :func:`_llama_unpermute`)."""
    reference = _take_rows(weight, _checked_rows(weight.shape[0]))
    if _matches(blocks, weight, reference):
        return True, None
    if heads and blocks.n % (2 * heads) == 0:
        order = _llama_unpermute(blocks.n, heads)
        if _matches(blocks.rows(order), weight, reference):
            return True, order
    return False, None


def _targets(weights: DecoderWeights, gguf_name: str, rows: int) -> list[tuple[str, np.ndarray, int | None]]:
    """(our weight name, the float weight, heads for a q/k permutation) for each part of a GGUF tensor
    of ``rows`` output rows."""
    cfg = weights.config
    if gguf_name == "output.weight":
        return [] if cfg.tie_word_embeddings else [("lm_head", weights.lm_head, None)]
    if gguf_name == "token_embd.weight":
        tied = cfg.tie_word_embeddings or weights.lm_head is weights.embed
        return [("lm_head", weights.lm_head, None)] if tied else []
    match = _LAYER_TENSOR.match(gguf_name)
    if not match or match.group(2) not in _LAYER_PARTS:
        return []
    i, kind = int(match.group(1)), match.group(2)
    layer = weights.layers[i]
    fields = _LAYER_PARTS[kind]
    if kind == "ffn_up" and layer.up.shape[0] * 2 == rows:  # Phi-3: gate and up fused in one tensor
        fields = ("gate", "up")
    heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads}
    return [(f"layers.{i}.{f}", getattr(layer, f), heads.get(f) if len(fields) == 1 else None) for f in fields]


@dataclass(frozen=True)
class _Carried:
    """Where one carried weight's blocks are: a GGUF tensor, and the rows of it (None: all, in order)."""

    tensor: object  # the GGUF reader's tensor record
    n: int
    k: int
    rows: np.ndarray | None

    def blocks(self, path: Path) -> CarriedBlocks:
        from edge_spec.export.gguf.tensors import read_raw

        blocks = carry_gguf(read_raw(path, self.tensor), self.tensor.tensor_type.name, self.n, self.k)
        return blocks if self.rows is None else blocks.rows(self.rows)


class GGUFBlocks(Mapping):
    """``weights.carried`` of a GGUF source: weight name -> :class:`CarriedBlocks`, decided by the check
    above the first time anything is asked (one GGUF matrix at a time), then read from the file each
    time a weight's blocks are asked for (none is kept).  Also the export's report of it
    (:meth:`summary`, :meth:`to_dict`: :class:`CarryReport`'s)."""

    def __init__(self, path: Path, weights: DecoderWeights, records: list | None = None) -> None:
        self.path = Path(path)
        self._weights = weights
        self._records = records  # the file's tensor records, where a reader has parsed them already
        self._plan: dict[str, _Carried] | None = None
        self._report = CarryReport()

    @property
    def report(self) -> CarryReport:
        self._decide()
        return self._report

    def summary(self) -> str:
        return self.report.summary()

    def to_dict(self) -> dict:
        return self.report.to_dict()

    def __getitem__(self, name: str) -> CarriedBlocks:
        return self._decide()[name].blocks(self.path)

    def __iter__(self) -> Iterator[str]:
        return iter(self._decide())

    def __len__(self) -> int:
        return len(self._decide())

    def _decide(self) -> dict[str, _Carried]:
        if self._plan is not None:
            return self._plan
        from gguf import GGUFReader

        plan: dict[str, _Carried] = {}
        report = self._report
        records = self._records if self._records is not None else GGUFReader(self.path).tensors
        for tensor in records:
            kind = tensor.tensor_type.name
            if len(tensor.shape) != 2 or kind in ("F32", "F16", "BF16"):
                continue
            k, n = int(tensor.shape[0]), int(tensor.shape[1])  # GGUF lists dimensions fastest first
            targets = _targets(self._weights, tensor.name, n)
            if not targets:
                continue
            for name, rows, why in self._check(tensor, kind, n, k, targets):
                if why:
                    report.fallback[name] = f"{kind}: {why}"
                    continue
                plan[name] = _Carried(tensor, n, k, rows)
                report.carried[kind] += 1
        self._plan = plan
        return plan

    def _check(self, tensor, kind: str, n: int, k: int, targets) -> list[tuple[str, np.ndarray | None, str]]:
        """(weight name, rows of the tensor it is, why not carried or "") per target of a GGUF tensor.
        A large tensor of one weight that no row order could change (an embedding, an MLP matrix) has
        only its checked rows decoded; the others are decoded whole."""
        from edge_spec.export.gguf.tensors import read_raw, read_raw_rows

        (name, weight, heads), *more = targets
        if not more and not heads and n > CHECKED_ROWS:
            rows = _checked_rows(n)
            sample = carry_gguf(read_raw_rows(self.path, tensor, rows), kind, len(rows), k)
            if sample is None:
                return [(name, None, "no exact MatMulNBits layout")]
            fits = weight.shape == (n, k) and _close(sample.dequantize(), _take_rows(weight, rows))
            return [(name, None, "" if fits else "blocks differ from the loaded weight")]
        blocks = carry_gguf(read_raw(self.path, tensor), kind, n, k)
        if blocks is None:
            return [(name, None, "no exact MatMulNBits layout") for name, _, _ in targets]
        checked, start = [], 0
        for name, weight, heads in targets:
            part_rows = None if len(targets) == 1 else np.arange(start, start + weight.shape[0])
            start += weight.shape[0]
            fits, order = _fit_rows(blocks if part_rows is None else blocks.rows(part_rows), weight, heads)
            rows = part_rows if order is None else (order if part_rows is None else part_rows[order])
            checked.append((name, rows, "" if fits else "blocks differ from the loaded weight"))
        return checked


def attach_gguf_blocks(path: Path, weights: DecoderWeights) -> CarryReport:
    """Fill ``weights.carried`` from the GGUF file ``path`` (every carried matrix in memory: for tests and
    studies; an export reads them as it builds, through :class:`GGUFBlocks`); returns what was carried
    and what was not."""
    blocks = GGUFBlocks(path, weights)
    for name in blocks:
        weights.carried[name] = blocks[name]
    return blocks.report
