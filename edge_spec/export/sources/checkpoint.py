"""A Hugging Face directory's safetensors weights, each read from its file when the graph builder asks.

``from_pretrained`` in float32 holds the whole model at four bytes a weight (6 GB for a 1.5B model)
before the first matrix is quantized.  The same float32 values come from the safetensors files one
tensor at a time (a 16-bit weight widened to float32 is exact, as transformers widens it), and a band of
rows at a time for an embedding-sized matrix.  The directory is read this way only where its files hold
every parameter of the model class under the names transformers gives them (checked against the class
built on the meta device, which costs no memory); any other checkpoint (``pytorch_model.bin``, renamed
or prefixed keys) is loaded through ``from_pretrained`` as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from edge_spec.export.graph.weights import DeferredMatrix


class SafetensorsTensors(Mapping):
    """Parameter name -> float32 array (1-D tensors) or :class:`DeferredMatrix`, read from ``*.safetensors``."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self._files: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for path in sorted(Path(directory).glob("*.safetensors")):
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():
                    self._files[name] = path
                    self._shapes[name] = tuple(handle.get_slice(name).get_shape())

    def __getitem__(self, name: str):
        shape = self._shapes[name]
        if len(shape) != 2:
            return self._read(name)
        return DeferredMatrix(shape, lambda: self._read(name), lambda a, b: self._read(name, slice(a, b)))

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self._shapes.get(name)

    def __len__(self) -> int:
        return len(self._files)

    def _read(self, name: str, rows: slice | None = None) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as handle:
            tensor = handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows]
        return np.array(tensor.float().numpy(), np.float32, copy=True)


def streamable(directory: Path, hf_config) -> tuple[SafetensorsTensors, str] | None:
    """(the directory's tensors, the model class name) where its safetensors files hold every parameter
    transformers' model class has (an LM head tied to the embedding may be absent); else None."""
    import torch
    from transformers import AutoModelForCausalLM

    if not any(Path(directory).glob("*.safetensors")):
        return None
    tensors = SafetensorsTensors(directory)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(hf_config)
    expected = {name: tuple(value.shape) for name, value in shell.state_dict().items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    if any(tensors.shape(name) != shape for name, shape in expected.items()):
        return None
    return tensors, type(shell).__name__
