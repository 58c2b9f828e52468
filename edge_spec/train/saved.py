"""Read a built EAGLE-3 head (ONNX, as a bundle or ``edge_spec/data/heads/`` keeps it) back into a torch head.

A head is shipped as its int4 graphs only, so that is all a machine may have of it.  Reading it back
lets ``train-head --init`` go on training the shipped head on new data (a user's own code, more
answers) instead of starting over, and lets it be written in the SpecForge format for a server
engine.  The weights come back dequantized: training resumes from the int4 point, which the head was
exported at anyway.

Sits beside :mod:`export.eagle.model` (the head and its SpecForge checkpoints), below :mod:`train.trainer`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import torch

from edge_spec.errors import EdgeSpecError
from edge_spec.export.eagle.model import Eagle3Config, Eagle3Head, load_specforge
from edge_spec.runtime.model.embedding import TargetLMHead, read_initializer

SAVED_RECORD = "eagle.json"


def load_head(source) -> tuple[Eagle3Config, Eagle3Head]:
    """A head from a saved-head directory (``eagle.json`` + ONNX), a bundle with an EAGLE head, a SpecForge
    checkpoint or a hub id."""
    directory = Path(source).expanduser()
    if (directory / SAVED_RECORD).is_file():
        return load_saved_head(directory)
    if (directory / "manifest.json").is_file():
        from edge_spec.manifest import read_manifest

        record = read_manifest(directory).get("eagle")
        if not record:
            raise EdgeSpecError(f"{directory} is a bundle without an EAGLE head")
        return load_saved_head(directory / "eagle", record)
    return load_specforge(source)


def load_saved_head(directory, record: dict | None = None) -> tuple[Eagle3Config, Eagle3Head]:
    """The torch head whose ONNX graphs ``directory`` holds (weights dequantized); ``record``: its
    manifest entry (default: ``directory/eagle.json``)."""
    directory = Path(directory)
    try:
        record = record if record is not None else json.loads((directory / SAVED_RECORD).read_text())
        config = Eagle3Config.from_hf_config(record["config"])
        layer_name = record["onnx"].removeprefix("eagle/")
        full = record["heads"]["full"]
        head_path = directory / full["onnx"].removeprefix("eagle/")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise EdgeSpecError(f"{directory}: not a saved EAGLE-3 head ({type(error).__name__}: {error})") from None
    layer_path = directory / layer_name
    layer = _Linears(layer_path)
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q, k, v = np.split(layer.weight("layers.0.qkv"), [heads * dim, heads * dim + kv * dim])
    gate, up = np.split(layer.weight("layers.0.gate_up"), 2)
    state = {
        "fc.weight": _Linears(directory / "fc.onnx").weight("fc"),
        "midlayer.hidden_norm.weight": layer.vector("layers.0.hidden_norm"),
        "midlayer.input_layernorm.weight": layer.vector("layers.0.input_layernorm"),
        "midlayer.self_attn.q_proj.weight": q,
        "midlayer.self_attn.k_proj.weight": k,
        "midlayer.self_attn.v_proj.weight": v,
        "midlayer.self_attn.o_proj.weight": layer.weight("layers.0.o"),
        "midlayer.post_attention_layernorm.weight": layer.vector("layers.0.post_norm"),
        "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": layer.weight("layers.0.down"),
        "norm.weight": layer.vector("final_norm"),
        "lm_head.weight": TargetLMHead.from_onnx(head_path).table(),
        "d2t": np.load(directory / "d2t.npy"),
        "t2d": np.load(directory / "t2d.npy"),
    }
    head = Eagle3Head(config)
    expected = head.state_dict()
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise EdgeSpecError(
                f"{directory}: {name} has shape {tuple(state[name].shape)}, its config says {tuple(tensor.shape)}"
            )
    head.load_state_dict({name: torch.from_numpy(np.array(state[name])).to(expected[name].dtype) for name in expected})
    return config, head.eval()


class _Linears:
    """The weights ``[N, K]`` of one graph's linear layers by name (``add_linear``'s layout)."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise EdgeSpecError(f"saved EAGLE-3 head file missing: {path}")
        self.path = path
        self.graph = onnx.load(str(path), load_external_data=False).graph

    def weight(self, name: str) -> np.ndarray:
        return TargetLMHead.from_linear(self.path, name, self.graph).table()

    def vector(self, name: str) -> np.ndarray:
        return np.array(read_initializer(self.path, name, self.graph), np.float32)
