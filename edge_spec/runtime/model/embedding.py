"""The target's token-embedding table (and other row tables), read straight from an exported graph.

An EAGLE-3 head takes the *target's* embeddings of the next tokens (its checkpoints leave the
table out), so the runtime and the head trainer need rows of that table without loading the
whole model.  Exported graphs keep it as initializers in the external ``.data`` file:

* int4 / int8 bundles: ``embed.qweight`` (uint8 ``[V, H * bits / 8]``, packed codes, element ``2j``
  in the low nibble for int4) and ``embed.scales`` (float32 ``[V, H / block]``) of a
  ``GatherBlockQuantized`` node - ``w = scale * (code - zero)`` with zero point 8 (int4) / 128 (int8),
  the layout of :func:`edge_spec.export.graph.quantize.quantize_blockwise`;
* fp32 bundles: ``embed.weight`` (float32 ``[V, H]``) of a ``Gather`` node.

Only the graph protobuf is parsed (``load_external_data=False``); the tensors are memory-mapped
from the data file at their recorded offset, and :meth:`RowTable.rows` dequantizes just the rows
asked for.  The same reader serves the LM head (``lm_head.qweight`` / ``lm_head.scales`` of a
``MatMulNBits`` node, same row layout; fp32: ``lm_head.weight`` stored transposed ``[H, V]``),
which the head trainer uses to turn stored final hidden states into the target's logits over
the draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from edge_spec.errors import EdgeSpecError


def _graph(onnx_path: Path) -> onnx.GraphProto:
    if not onnx_path.is_file():
        raise EdgeSpecError(f"ONNX model not found: {onnx_path}")
    return onnx.load(str(onnx_path), load_external_data=False).graph


def read_initializer(onnx_path, name: str, graph: onnx.GraphProto | None = None) -> np.ndarray:
    """Initializer ``name`` of the graph at ``onnx_path`` as a (read-only, memory-mapped when the
    tensor lives in an external data file) numpy array of its recorded shape."""
    onnx_path = Path(onnx_path)
    graph = graph if graph is not None else _graph(onnx_path)
    tensor = next((t for t in graph.initializer if t.name == name), None)
    if tensor is None:
        raise EdgeSpecError(f"{onnx_path} has no initializer {name!r}")
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    info = {entry.key: entry.value for entry in tensor.external_data}
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    shape = tuple(int(d) for d in tensor.dims)
    count = int(np.prod(shape, dtype=np.int64))
    offset = int(info.get("offset", 0))
    length = int(info.get("length", count * dtype.itemsize))
    if length != count * dtype.itemsize:
        raise EdgeSpecError(f"{onnx_path}: initializer {name!r} records {length} bytes for shape {shape}")
    data = onnx_path.parent / info["location"]
    if not data.is_file():
        raise EdgeSpecError(f"{onnx_path}: external data file {data} is missing")
    if data.stat().st_size < offset + length:
        raise EdgeSpecError(f"{data} is shorter than initializer {name!r} needs (truncated copy?)")
    return np.memmap(data, dtype=dtype, mode="r", offset=offset, shape=shape)


def _unpack_int4(packed: np.ndarray) -> np.ndarray:
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


class RowTable:
    """A ``[V, H]`` weight whose rows are dequantized on demand (block-quantized) or read (fp32)."""

    def __init__(
        self,
        *,
        packed: np.ndarray | None = None,
        scales: np.ndarray | None = None,
        bits: int = 4,
        block_size: int = 32,
        dense: np.ndarray | None = None,
        transposed: bool = False,
        hidden_size: int | None = None,
    ) -> None:
        self.packed, self.dense, self.bits, self.block_size = packed, dense, bits, block_size
        self.transposed = transposed
        if dense is not None:
            self.num_rows, self.hidden_size = (dense.shape[1], dense.shape[0]) if transposed else dense.shape
            return
        if bits not in (4, 8):
            raise EdgeSpecError(f"unsupported quantization: {bits} bits")
        n = packed.shape[0]
        self.packed = packed.reshape(n, -1)  # [V, blocks * block * bits / 8]
        blocks = self.packed.shape[1] * 8 // bits // block_size
        self.scales = scales.reshape(n, blocks)
        self.num_rows = n
        self.hidden_size = hidden_size or blocks * block_size

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.hidden_size

    def rows(self, ids) -> np.ndarray:
        """float32 ``[n, H]``: the rows ``ids`` (any integer array-like; repeats allowed)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_rows):
            raise EdgeSpecError(f"token ids must lie in [0, {self.num_rows}), got {ids.min()}..{ids.max()}")
        if self.dense is not None:
            block = self.dense[:, ids].T if self.transposed else self.dense[ids]
            return np.ascontiguousarray(block, dtype=np.float32)
        order = np.argsort(ids, kind="stable")  # memmap reads in file order
        packed = np.empty((ids.size, self.packed.shape[1]), np.uint8)
        packed[order] = self.packed[ids[order]]
        codes = _unpack_int4(packed) if self.bits == 4 else packed
        zero = float(1 << (self.bits - 1))
        values = codes.reshape(ids.size, -1, self.block_size).astype(np.float32) - zero
        values *= np.asarray(self.scales[ids], dtype=np.float32)[:, :, None]
        return values.reshape(ids.size, -1)[:, : self.hidden_size]

    def table(self, chunk: int = 8192) -> np.ndarray:
        """float32 ``[V, H]``: every row (chunked, so peak memory is the table plus one chunk)."""
        out = np.empty(self.shape, np.float32)
        for start in range(0, self.num_rows, chunk):
            stop = min(start + chunk, self.num_rows)
            out[start:stop] = self.rows(np.arange(start, stop))
        return out


def _node_attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


class TargetEmbedding(RowTable):
    """The target graph's token embedding (``embed.*`` initializers of its Gather node)."""

    @classmethod
    def from_onnx(cls, onnx_path) -> TargetEmbedding:
        onnx_path = Path(onnx_path)
        graph = _graph(onnx_path)
        node = next(
            (
                n
                for n in graph.node
                if n.op_type in ("GatherBlockQuantized", "Gather") and n.input and n.input[0].startswith("embed.")
            ),
            None,
        )
        if node is None:
            raise EdgeSpecError(f"{onnx_path} has no embedding lookup (embed.* Gather / GatherBlockQuantized)")
        if node.op_type == "Gather":
            return cls(dense=read_initializer(onnx_path, node.input[0], graph))
        attrs = _node_attrs(node)
        if attrs.get("gather_axis", 0) != 0 or attrs.get("quantize_axis", 1) != 1 or len(node.input) > 3:
            raise EdgeSpecError(f"{onnx_path}: unsupported embedding quantization layout {attrs}")
        return cls(
            packed=read_initializer(onnx_path, node.input[0], graph),
            scales=read_initializer(onnx_path, node.input[2], graph),
            bits=int(attrs.get("bits", 4)),
            block_size=int(attrs.get("block_size", 128)),
        )


class TargetLMHead(RowTable):
    """The target graph's LM head ``[V, H]`` (``lm_head.*`` of its MatMulNBits / MatMul node): rows
    are what the target's logits are dot products with (logit_i = row_i · final-normed hidden)."""

    @classmethod
    def from_onnx(cls, onnx_path) -> TargetLMHead:
        return cls.from_linear(onnx_path, "lm_head")

    @classmethod
    def from_linear(cls, onnx_path, name: str, graph: onnx.GraphProto | None = None):
        """The weight ``[N, K]`` of linear layer ``name`` (``name.qweight`` / ``name.scales`` of a
        MatMulNBits node, or ``name.weight`` of a MatMul, stored transposed), as ``add_linear`` writes it."""
        onnx_path = Path(onnx_path)
        graph = graph if graph is not None else _graph(onnx_path)
        node = next(
            (
                n
                for n in graph.node
                if n.op_type in ("MatMulNBits", "MatMul")
                and len(n.input) > 1
                and n.input[1] in (name + ".qweight", name + ".weight")
            ),
            None,
        )
        if node is None:
            raise EdgeSpecError(f"{onnx_path} has no linear layer {name!r} ({name}.* MatMul / MatMulNBits)")
        if node.op_type == "MatMul":
            return cls(dense=read_initializer(onnx_path, node.input[1], graph), transposed=True)
        attrs = _node_attrs(node)
        if len(node.input) > 3 and any(node.input[3:]):
            raise EdgeSpecError(f"{onnx_path}: {name} with zero points / bias is not supported")
        return cls(
            packed=read_initializer(onnx_path, node.input[1], graph),
            scales=read_initializer(onnx_path, node.input[2], graph),
            bits=int(attrs["bits"]),
            block_size=int(attrs["block_size"]),
            hidden_size=int(attrs["K"]),
        )


__all__ = ["RowTable", "TargetEmbedding", "TargetLMHead", "read_initializer"]
