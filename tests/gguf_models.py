"""GGUF files written in-process, the way llama.cpp lays them out, for tests that load a GGUF source end to end.

Two kinds: :func:`write_model_gguf` converts a tiny transformers model (its weights quantized with the
gguf package's own quantizers, Llama q/k rows permuted as llama.cpp's converter does), and
:func:`write_random_qwen2_gguf` writes a larger Qwen2 of random, valid K-quant blocks (Q4_K and Q6_K
as a Q4_K_M file mixes them; the gguf package cannot quantize to K-quants) for memory measurements.
Both carry the tiny byte-level BPE tokenizer of ``tiny_models`` in the file's metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

QK_K = 256
#: transformers' parameter name (after ``model.layers.N.``) -> GGUF tensor name (after ``blk.N.``)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _tokenizer_metadata(writer, tokenizer) -> None:
    """The tokenizer as llama.cpp writes a byte-level BPE vocabulary (``gpt2`` model, Qwen2 pre-tokenizer)."""
    from gguf import TokenType

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    special = set(tokenizer.all_special_ids)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _architecture_metadata(writer, arch: str, cfg: dict) -> None:
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])


def finish_gguf(writer) -> None:
    """Writes a ``GGUFWriter``'s header, metadata and tensors to its file, in the order the format needs, and
    closes it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def count_gguf_parses(monkeypatch) -> list:
    """Makes every ``gguf.GGUFReader(...)`` of the test record the path it parses, in order, in the returned
    list (the reader still parses it), for tests that a load parses a file's header once."""
    import gguf

    parses = []

    class Counted(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            parses.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    return parses


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of each head's q/k rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_model_gguf(path: Path, model, tokenizer, arch: str, kinds: dict[str, str] | None = None) -> Path:
    """``model`` (a tiny transformers Qwen2 or Llama) as a GGUF file of architecture ``arch``; ``kinds``:
    GGUF type per tensor-name fragment (``"attn_q"``: ``"Q4_0"``), Q8_0 for other matrices, F32 for
    norms and biases.  Returns ``path``."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter, quants

    kinds = kinds or {}
    cfg = model.config.to_dict()
    writer = GGUFWriter(path, arch)
    _architecture_metadata(writer, arch, cfg)
    _tokenizer_metadata(writer, tokenizer)
    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    for name, value in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        gguf_name = _gguf_name(name)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads"] if "attn_q" in gguf_name else cfg["num_key_value_heads"]
            value = _llama_permute(value, heads)
        if value.ndim == 1:
            writer.add_tensor(gguf_name, value.astype(np.float32))
            continue
        kind = next((k for fragment, k in kinds.items() if fragment in gguf_name), "Q8_0")
        writer.add_tensor(gguf_name, quants.quantize(value, getattr(T, kind)), raw_dtype=getattr(T, kind))
    finish_gguf(writer)
    return path


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")  # model.layers.N.<module...>.weight|bias
    module, suffix = ".".join(parts[3:-1]), parts[-1]
    return f"blk.{parts[2]}.{LAYER_NAMES[module]}.{suffix}"


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(len(values), 2)


def random_k_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes [n, row bytes] of a random ``kind`` (Q4_K or Q6_K) weight [n, k] with valid scales, so it
    dequantizes to finite weights of a plausible size."""
    blocks = n * k // QK_K
    if kind == "Q4_K":  # d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        d, dmin = _f16(rng.uniform(0.0005, 0.002, blocks)), _f16(rng.uniform(0.0, 0.002, blocks))
        rest = rng.integers(0, 256, (blocks, 140), dtype=np.uint8)
        return np.concatenate([d, dmin, rest], axis=1).reshape(n, -1)
    if kind == "Q6_K":  # 128 bytes low bits, 64 high bits, 16 int8 scales, d (f16)
        codes = rng.integers(0, 256, (blocks, 208), dtype=np.uint8)
        return np.concatenate([codes, _f16(rng.uniform(0.00005, 0.0002, blocks))], axis=1).reshape(n, -1)
    raise ValueError(kind)


def write_random_qwen2_gguf(
    path: Path,
    tokenizer,
    *,
    vocab_size: int,
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int = 16,
    kv_heads: int = 2,
    seed: int = 0,
) -> Path:
    """A random Qwen2 (tied embeddings, q/k/v biases) typed as a Q4_K_M file: Q6_K embedding and every
    other layer's V and down projections, Q4_K elsewhere, F32 norms and biases."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    cfg = dict(
        max_position_embeddings=4096,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        vocab_size=vocab_size,
    )
    writer = GGUFWriter(path, "qwen2")
    _architecture_metadata(writer, "qwen2", cfg)
    _tokenizer_metadata(writer, tokenizer)

    def matrix(name: str, kind: str, n: int, k: int) -> None:
        writer.add_tensor(name, random_k_blocks(kind, n, k, rng), raw_dtype=getattr(T, kind))

    def vector(name: str, size: int, centre: float, spread: float) -> None:
        writer.add_tensor(name, (centre + spread * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", "Q6_K", vocab_size, hidden)
    for i in range(layers):
        wide = "Q6_K" if i % 2 == 0 else "Q4_K"
        vector(f"blk.{i}.attn_norm.weight", hidden, 1.0, 0.1)
        for part, rows, kind in (
            ("q", hidden, "Q4_K"),
            ("k", kv_heads * head_dim, "Q4_K"),
            ("v", kv_heads * head_dim, wide),
        ):
            matrix(f"blk.{i}.attn_{part}.weight", kind, rows, hidden)
            vector(f"blk.{i}.attn_{part}.bias", rows, 0.0, 0.1)
        matrix(f"blk.{i}.attn_output.weight", "Q4_K", hidden, hidden)
        vector(f"blk.{i}.ffn_norm.weight", hidden, 1.0, 0.1)
        matrix(f"blk.{i}.ffn_gate.weight", "Q4_K", intermediate, hidden)
        matrix(f"blk.{i}.ffn_up.weight", "Q4_K", intermediate, hidden)
        matrix(f"blk.{i}.ffn_down.weight", wide, hidden, intermediate)
    vector("output_norm.weight", hidden, 1.0, 0.1)
    finish_gguf(writer)
    return path
