"""A bundle with a real bundle's shapes and seeded random weights (``benchmarks/shaped_bundle.py``).

A pass's cost depends on the shapes (layers, widths, heads, vocabulary, quantization), not on the
values, so a machine the real weights cannot reach (no network, a small upload) can still be priced:
:func:`save_shapes` keeps what a build needs (the configs and the tokenizer, about 1.4 MB), and
:func:`build` exports from it without transformers.  Acceptance is not carried (the weights are
random), nor the real target's carried-GGUF graph (this one is plain symmetric int4).
"""

from __future__ import annotations

import json
import lzma
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from edge_spec.export.bundle.build import ExportOptions, export_bundle
from edge_spec.export.graph.weights import weights_from_state_dict
from edge_spec.export.sources.resolve import LoadedModel

ROLES = ("target", "draft")


class UnsupportedShapes(ValueError):
    """The saved shapes are of a family :func:`random_state` cannot fill (it writes Qwen2 tensors)."""


def _say(message: str) -> None:
    print(message, flush=True)


class BundleTokenizer:
    """The bundle's tokenizer as the exporter reads one (backend, chat template, special tokens, vocabulary),
    built from tokenizer.json alone: the machine that builds this bundle need not have transformers."""

    def __init__(self, tokenizer_json: bytes, config: dict) -> None:
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_str(tokenizer_json.decode())
        self.chat_template = config.get("chat_template")
        self.bos_token = config.get("bos_token")
        self.eos_token = config.get("eos_token")
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.eos_token_ids = list(config.get("eos_token_ids", []))
        self.all_special_ids = sorted(
            i for i, token in self.backend_tokenizer.get_added_tokens_decoder().items() if token.special
        )

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)


def save_shapes(bundle: Path, out: Path) -> None:
    """The two models' configs and the tokenizer of ``bundle``, small enough to travel."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    shapes = {role: {"name": manifest[role]["name"], "config": manifest[role]["config"]} for role in ROLES}
    (out / "shapes.json").write_text(json.dumps(shapes, indent=1))
    (out / "tokenizer.json.xz").write_bytes(lzma.compress((bundle / "tokenizer.json").read_bytes(), preset=9))
    shutil.copy(bundle / "tokenizer_config.json", out / "tokenizer_config.json")


def random_state(config: dict, seed: int) -> dict[str, np.ndarray]:
    """A Qwen2-family state dict of ``config``'s shapes: N(0, 0.02) matrices, unit norms, small biases."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_rows, kv_rows = config["num_heads"] * config["head_dim"], config["num_kv_heads"] * config["head_dim"]

    def matrix(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)

    state = {
        "model.embed_tokens.weight": matrix(config["vocab_size"], hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
    }
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = matrix(config["vocab_size"], hidden)
    for i in range(config["num_layers"]):
        p = f"model.layers.{i}."
        state.update(
            {
                p + "input_layernorm.weight": np.ones(hidden, np.float32),
                p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                p + "self_attn.q_proj.weight": matrix(q_rows, hidden),
                p + "self_attn.k_proj.weight": matrix(kv_rows, hidden),
                p + "self_attn.v_proj.weight": matrix(kv_rows, hidden),
                p + "self_attn.q_proj.bias": matrix(1, q_rows)[0],
                p + "self_attn.k_proj.bias": matrix(1, kv_rows)[0],
                p + "self_attn.v_proj.bias": matrix(1, kv_rows)[0],
                p + "self_attn.o_proj.weight": matrix(hidden, q_rows),
                p + "mlp.gate_proj.weight": matrix(inter, hidden),
                p + "mlp.up_proj.weight": matrix(inter, hidden),
                p + "mlp.down_proj.weight": matrix(hidden, inter),
            }
        )
    return state


def hf_like_config(config: dict) -> SimpleNamespace:
    """What ``weights.config_from_hf`` reads from a transformers config, from a manifest's config."""
    if config["architecture"] != "Qwen2ForCausalLM":
        raise UnsupportedShapes(f"a shaped bundle has Qwen2-family shapes only, not {config['architecture']}")
    return SimpleNamespace(
        architectures=[config["architecture"]],
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_layers"],
        num_attention_heads=config["num_heads"],
        num_key_value_heads=config["num_kv_heads"],
        head_dim=config["head_dim"],
        rope_theta=config["rope_theta"],
        rms_norm_eps=config["rms_norm_eps"],
        max_position_embeddings=config["max_position_embeddings"],
        tie_word_embeddings=config["tie_word_embeddings"],
        hidden_act="silu",
        rope_scaling=None,
    )


def build(
    shapes_dir: Path,
    out: Path,
    layers: int | None,
    context_length: int,
    seed: int,
    accuracy_level: int = 4,
    progress: Callable[[str], None] = _say,
) -> None:
    """Export a bundle of the shapes :func:`save_shapes` wrote, with seeded random weights, into ``out``
    (``layers``: keep at most that many layers per model); ``progress`` hears each step."""
    shapes = json.loads((shapes_dir / "shapes.json").read_text())
    tokenizer = BundleTokenizer(
        lzma.decompress((shapes_dir / "tokenizer.json.xz").read_bytes()),
        json.loads((shapes_dir / "tokenizer_config.json").read_text()),
    )

    def load(role: str) -> LoadedModel:
        config = dict(shapes[role]["config"])
        if layers:
            config["num_layers"] = min(layers, config["num_layers"])
        started = time.perf_counter()
        weights = weights_from_state_dict(hf_like_config(config), random_state(config, seed + ROLES.index(role)))
        progress(f"{role}: random {config['num_layers']}-layer weights in {time.perf_counter() - started:.1f} s")
        return LoadedModel(
            f"shaped-{shapes[role]['name']}", f"random:{role}", weights, tokenizer, tokenizer.eos_token_ids
        )

    export_bundle(
        "target",
        "draft",
        out,
        ExportOptions(context_length=context_length, accuracy_level=accuracy_level),
        loader=load,
        progress=progress,
    )
