"""Rotary position tables, with the rope scaling variants the supported families use, computed at export time.

Why tables and not ops: ``GroupQueryAttention`` takes ``cos_cache`` / ``sin_cache`` inputs indexed by
position, so every scaling scheme (linear, Llama 3, YaRN, Phi's LongRoPE) reduces to a different table
and costs nothing at run time.  The formulas follow transformers' ``modeling_rope_utils`` so that an
exported graph computes what transformers computes for the same checkpoint.

A scheme whose frequencies depend on how long the sequence is (LongRoPE: short factors up to the
pretrained context, long factors beyond) yields two tables and the length at which the second takes
over; the graph picks one per call from ``total_sequence_length`` as transformers does per forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edge_spec.errors import EdgeSpecError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeTable:
    """cos/sin [positions, rotary_dim / 2], already multiplied by the scheme's attention factor."""

    cos: np.ndarray
    sin: np.ndarray


@dataclass(frozen=True)
class RopeTables:
    """``short`` serves every call; ``long`` (if any) replaces it once the sequence passes ``switch_at``."""

    short: RopeTable
    long: RopeTable | None = None
    switch_at: int = 0


def rope_type(scaling: dict | None) -> str:
    """The scheme a transformers ``rope_scaling`` dict names ("default" when there is none)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def check_rope_scaling(scaling: dict | None) -> None:
    """Refuse, in one line, a scheme the exporter cannot reproduce."""
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise EdgeSpecError(f"rope scaling type {kind!r} is not supported; edge-spec exports {', '.join(ROPE_TYPES)}")


def _base_inv_freq(dim: int, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _llama3(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: dict, max_positions: int) -> tuple[np.ndarray, float]:
    factor = float(s["factor"])
    original = int(s.get("original_max_position_embeddings") or max_positions)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention = mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope_attention(s: dict, max_positions: int, original: int) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _table(inv_freq: np.ndarray, positions: int, attention: float) -> RopeTable:
    # float32 like transformers: its cos/sin come from a float32 product of positions and frequencies
    freqs = np.outer(np.arange(positions, dtype=np.float32), inv_freq.astype(np.float32)).astype(np.float32)
    return RopeTable((np.cos(freqs) * attention).astype(np.float32), (np.sin(freqs) * attention).astype(np.float32))


def rope_tables(
    rotary_dim: int,
    theta: float,
    scaling: dict | None,
    positions: int,
    max_positions: int,
    original_max_positions: int | None = None,
) -> RopeTables:
    """Tables for positions ``[0, positions)`` of a rotary embedding over ``rotary_dim`` channels.

    ``max_positions`` is the model's ``max_position_embeddings``; ``original_max_positions`` its
    pretrained context where the config names one apart from the scaling dict (Phi-3)."""
    check_rope_scaling(scaling)
    kind, s = rope_type(scaling), scaling or {}
    inv_freq = _base_inv_freq(rotary_dim, theta)
    if kind == "default":
        return RopeTables(_table(inv_freq, positions, 1.0))
    if kind == "linear":
        return RopeTables(_table(inv_freq / float(s["factor"]), positions, 1.0))
    if kind == "llama3":
        return RopeTables(_table(_llama3(inv_freq, s), positions, 1.0))
    if kind == "yarn":
        yarn_freq, attention = _yarn(rotary_dim, theta, s, max_positions)
        return RopeTables(_table(yarn_freq, positions, attention))
    original = int(original_max_positions or s.get("original_max_position_embeddings") or max_positions)
    attention = _longrope_attention(s, max_positions, original)
    short = _table(inv_freq / np.asarray(s["short_factor"], np.float64), positions, attention)
    long = _table(inv_freq / np.asarray(s["long_factor"], np.float64), positions, attention)
    if positions <= original:
        return RopeTables(short)
    return RopeTables(short, long, original)
