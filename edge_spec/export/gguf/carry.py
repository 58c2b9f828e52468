"""Attach a GGUF file's quantized blocks to the weights transformers loaded from it, so the graph builder
carries them into ``MatMulNBits`` instead of re-quantizing the dequantized floats (see gguf/blocks.py).

Every carried matrix is checked against the float weight transformers produced for the same name (its
GGUF loader dequantizes, and for Llama-family files undoes llama.cpp's Q/K row permutation): a matrix is
carried only if the blocks reproduce that weight, so a name mapping or permutation this module does not
know falls back to re-quantization instead of exporting a wrong model.  What fell back, and why, is
returned for the export summary and the bundle manifest.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edge_spec.export.gguf.blocks import CarriedBlocks, carry_gguf
from edge_spec.export.weights import DecoderWeights

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


CHECKED_ROWS = 4096  # rows compared per matrix: all of a layer's, a spread of an embedding-sized head's


def _matches(blocks: CarriedBlocks, weight: np.ndarray) -> bool:
    if blocks.n != weight.shape[0] or blocks.k != weight.shape[1]:
        return False
    rows = np.unique(np.linspace(0, blocks.n - 1, min(blocks.n, CHECKED_ROWS)).astype(np.int64))
    deq, ref = blocks.rows(rows).dequantize(), weight[rows]
    return bool(np.allclose(deq, ref, rtol=1e-5, atol=1e-6 * max(float(np.abs(ref).max()), 1e-30)))


def _fit(blocks: CarriedBlocks, weight: np.ndarray, heads: int | None) -> CarriedBlocks | None:
    """``blocks`` as ``weight`` holds them: unchanged, or with the Llama q/k row order undone."""
    if _matches(blocks, weight):
        return blocks
    if heads and blocks.n % (2 * heads) == 0:
        permuted = blocks.rows(_llama_unpermute(blocks.n, heads))
        if _matches(permuted, weight):
            return permuted
    return None


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


def attach_gguf_blocks(path: Path, weights: DecoderWeights) -> CarryReport:
    """Fill ``weights.carried`` from the GGUF file ``path``; returns what was carried and what was not."""
    from gguf import GGUFReader

    report = CarryReport()
    reader = GGUFReader(path)
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if len(tensor.shape) != 2 or kind in ("F32", "F16", "BF16"):
            continue
        k, n = int(tensor.shape[0]), int(tensor.shape[1])  # GGUF lists dimensions fastest first
        targets = _targets(weights, tensor.name, n)
        if not targets:
            continue
        blocks = carry_gguf(np.asarray(tensor.data), kind, n, k)
        if blocks is None:
            for name, _, _ in targets:
                report.fallback[name] = f"{kind}: no exact MatMulNBits layout"
            continue
        start = 0
        for name, weight, heads in targets:
            part = blocks if len(targets) == 1 else blocks.rows(np.arange(start, start + weight.shape[0]))
            start += weight.shape[0]
            fitted = _fit(part, weight, heads)
            if fitted is None:
                report.fallback[name] = f"{kind}: blocks differ from the loaded weight"
                continue
            weights.carried[name] = fitted
            report.carried[kind] += 1
    return report
