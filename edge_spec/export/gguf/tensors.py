"""A GGUF file's weights under transformers' parameter names, each read from the file when the graph
builder asks for it.

transformers' GGUF loader dequantizes every tensor of the file into one float32 state dict before the
model sees any (six bytes of memory per weight of a 1.5B model at its peak, besides the mapped file).
This mapping gives the same float32 values, tensor by tensor: the same name map (transformers'
``get_gguf_hf_weights_map`` over the model class, built on the meta device: no memory), the same
dequantization (``gguf.dequantize``) and the same per-architecture fix-ups (transformers' tensor
processors: Llama's q/k row order, Gemma's norm offset).  A matrix comes as a
:class:`~edge_spec.export.graph.weights.DeferredMatrix`: its bytes are read from the file (not through the
reader's memory map, whose touched pages would stay resident) when the builder needs it, and for an
embedding-sized matrix a band of rows at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from edge_spec.export.graph.weights import DeferredMatrix


class GGUFTensors(Mapping):
    """transformers' state-dict names -> float32 arrays (1-D tensors: norms, biases) or deferred matrices."""

    def __init__(self, path: Path, hf_config) -> None:
        import torch
        from gguf import GGUFReader
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            load_gguf_checkpoint,
            read_field,
        )

        self.path = Path(path)
        reader = GGUFReader(self.path)
        self._parsed = load_gguf_checkpoint(str(self.path), return_tensors=False)
        architecture = read_field(reader, "general.architecture")[0]
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(hf_config)
        self.model_class = type(shell).__name__
        self._names = get_gguf_hf_weights_map(shell)  # GGUF name -> transformers name
        del shell
        self._processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=self._parsed.get("config", {}))
        self.records = list(reader.tensors)  # every tensor's name, type, shape and place in the file
        # the processors of the families exported here keep each tensor's name, so it maps as it is
        self._tensors = {self._names[t.name]: t for t in self.records if t.name in self._names}

    def _process(self, weights: np.ndarray, gguf_name: str):
        return self._processor.process(
            weights=weights, name=gguf_name, tensor_key_mapping=self._names, parsed_parameters=self._parsed
        )

    def __getitem__(self, name: str):
        tensor = self._tensors[name]
        if len(tensor.shape) != 2:
            return self._read(tensor)
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dimensions fastest first
        if not self._row_local(tensor.name):
            return DeferredMatrix(shape, lambda: self._read(tensor))
        return DeferredMatrix(
            shape,
            lambda: self._read(tensor),
            lambda a, b: self._read(tensor, read_raw(self.path, tensor, a, b)),
            lambda index: self._read(tensor, read_raw_rows(self.path, tensor, index)),
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def _row_local(self, gguf_name: str) -> bool:
        """Whether transformers' processor leaves this matrix's rows as they are (so a band of rows can be
        read alone): always for the plain processor, all but q/k for Llama's (it reorders their rows
        within each head), all matrices for Gemma's (it shifts norms only)."""
        from transformers.modeling_gguf_pytorch_utils import (
            Gemma2TensorProcessor,
            LlamaTensorProcessor,
            TensorProcessor,
        )

        kind = type(self._processor)
        if kind is TensorProcessor or kind is Gemma2TensorProcessor:
            return True
        if kind is LlamaTensorProcessor:
            return ".attn_q." not in gguf_name and ".attn_k." not in gguf_name
        return False

    def _read(self, tensor, raw: np.ndarray | None = None) -> np.ndarray:
        """``tensor`` (or the rows of it in ``raw``, its bytes) as transformers loads it: dequantized,
        then through the architecture's processor."""
        from gguf import dequantize

        raw = read_raw(self.path, tensor) if raw is None else raw
        weights = dequantize(raw, tensor.tensor_type)
        return np.ascontiguousarray(self._process(weights, tensor.name).weights, np.float32)


def read_raw(path: Path, tensor, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows ``[start, stop)`` of a GGUF reader's ``tensor`` read from the file into memory of their own,
    in the reader's dtype and row layout (``tensor.data``'s, whose pages are not touched)."""
    layout = tensor.data  # a view of the reader's memory map: shape and dtype only are read here
    rows = layout.shape[0]
    stop = rows if stop is None else min(stop, rows)
    row_bytes = int(tensor.n_bytes) // rows
    count = (stop - start) * row_bytes
    raw = np.fromfile(path, dtype=np.uint8, count=count, offset=int(tensor.data_offset) + start * row_bytes)
    if raw.size != count:
        raise ValueError(f"{tensor.name}: the file ends inside the tensor")
    return raw.view(layout.dtype).reshape((stop - start,) + layout.shape[1:])


RAW_BAND_BYTES = 64 << 20  # bytes of a tensor read at a time when picking rows out of it


def read_raw_rows(path: Path, tensor, index: np.ndarray) -> np.ndarray:
    """Rows ``index`` (sorted) of ``tensor`` as :func:`read_raw` gives them, read a band at a time."""
    index = np.asarray(index, np.int64)
    rows = tensor.data.shape[0]
    step = max(1, RAW_BAND_BYTES // max(int(tensor.n_bytes) // rows, 1))
    pieces = []
    for start in range(0, rows, step):
        wanted = index[(index >= start) & (index < start + step)]
        if len(wanted):
            pieces.append(read_raw(path, tensor, int(wanted[0]), int(wanted[-1]) + 1)[wanted - wanted[0]])
    return np.concatenate(pieces) if pieces else read_raw(path, tensor, 0, 0)
