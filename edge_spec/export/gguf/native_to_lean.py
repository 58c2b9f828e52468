"""A ``native``-layout graph in the ``lean`` layout's form, rewritten in memory where its op cannot run.

``--gguf-layout native`` stores the target's Q4_K and Q6_K matrices as GGUF's own bytes under the native
``MatMulGGUF`` op, which needs the library ``edge_spec.native`` builds (Linux, a C++ compiler, an AVX2 CPU
to be worth it) and the CPU execution provider.  Elsewhere the same bundle still loads: each record is
turned back into GGUF's bytes (:func:`~edge_spec.export.gguf.interleaved.deinterleave`) and carried into
``MatMulNBits`` by the exporter's own code, so the rewritten graph holds exactly the nodes and weights that
``--gguf-layout lean`` exports for the same GGUF file, and decodes as a lean bundle does; only the pass that
ranks a re-scored LM head's rows keeps the native layout's Q4_K blocks (``blocks.coarse_head``), where lean
has ``narrow_to_4bit``'s.  The rewritten weights live in memory (ORT takes them as external initializers);
the bundle's files are not touched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edge_spec.export.bundle.options import layout_settings
from edge_spec.export.gguf.blocks import ACCURACY_LEVEL_KEY, NATIVE_DOMAIN, add_carried_linear, carry_gguf
from edge_spec.export.gguf.interleaved import TYPE_NUMBER, deinterleave, record_width
from edge_spec.export.graph.builder import BuildOptions, Graph, gated_product

OP = "MatMulGGUF"
RECORDS_SUFFIX = ".gguf_records"
_TYPE_NAME = {number: name for name, number in TYPE_NUMBER.items()}


class _InMemoryGraph(Graph):
    """The graph builder's :class:`Graph`, keeping each new weight as an array instead of an initializer."""

    def __init__(self) -> None:
        super().__init__()
        self.arrays: dict[str, np.ndarray] = {}

    def const(self, name: str, array: np.ndarray) -> str:
        self.arrays[name] = np.ascontiguousarray(array)
        return name


def _attributes(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute}


def _accuracy_level(model: onnx.ModelProto) -> int:
    """The level the export gave ``MatMulNBits``, which lean gives every matmul: recorded in the graph's
    metadata, or (graphs exported with an LM head under ``MatMulNBits``) that node's."""
    for entry in model.metadata_props:
        if entry.key == ACCURACY_LEVEL_KEY:
            return int(entry.value)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            return _attributes(node).get("accuracy_level", 0)
    return 4


INLINE_BYTES = 1024  # smaller arrays (shapes, axes: what shape inference reads) stay in the graph itself


def _placeholder(name: str, array: np.ndarray) -> onnx.TensorProto:
    """An initializer whose data ORT takes from memory (``SessionOptions.add_external_initializers``)."""
    tensor = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
    tensor.dims.extend(array.shape)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="in-memory")
    return tensor


def _copy(message):
    twin = type(message)()
    twin.CopyFrom(message)
    return twin


def rewrite_as_lean(model: onnx.ModelProto, base_dir: Path) -> dict[str, np.ndarray]:
    """Replace ``model``'s ``MatMulGGUF`` nodes (in place) by the ``lean`` layout's nodes for the same
    blocks; returns the new large weights, which the caller hands ORT from memory and keeps alive as
    long as the session (the small ones are in the graph).  ``base_dir``: where the graph's external data file is."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    old_nodes = list(graph.node)
    consumers: dict[str, list[int]] = {}
    for index, node in enumerate(old_nodes):
        for name in node.input:
            consumers.setdefault(name, []).append(index)
    options = BuildOptions(accuracy_level=_accuracy_level(model), **layout_settings("lean"))
    arrays: dict[str, np.ndarray] = {}
    dropped_nodes: set[int] = set()
    dropped_weights: set[str] = set()
    replacement: dict[int, list[onnx.NodeProto]] = {}
    for index, node in enumerate(old_nodes):
        if node.op_type != OP or node.domain != NATIVE_DOMAIN:
            continue
        attrs = _attributes(node)
        records_name = node.input[1]
        if not records_name.endswith(RECORDS_SUFFIX) or records_name not in initializers:
            raise ValueError(f"{node.name}: its weights are not an initializer named *{RECORDS_SUFFIX}")
        name = records_name[: -len(RECORDS_SUFFIX)]
        n, k, kind = attrs["N"], attrs["K"], attrs["type"]
        padded = record_width(k)  # rows of a narrower input end in zeros
        records = numpy_helper.to_array(initializers[records_name], str(base_dir))
        raw = deinterleave(records, kind, n, padded, attrs.get("tail", 8))
        blocks = carry_gguf(raw, _TYPE_NAME[kind], n, padded)
        del records, raw
        bias = None
        followers = consumers.get(node.output[0], [])
        bias_name = name + ".bias"
        add = old_nodes[followers[0]] if len(followers) == 1 else None
        if add is not None and add.op_type == "Add" and bias_name in add.input:
            # the export's bias after the native op: lean passes it to MatMulNBits
            bias = numpy_helper.to_array(initializers[bias_name], str(base_dir))
            dropped_nodes.add(followers[0])
            dropped_weights.add(bias_name)
            out = add.output[0]
        else:
            out = node.output[0]
        part = _InMemoryGraph()
        x = node.input[0]
        if padded != k:  # MatMulNBits reads the records' whole width: the input gets the zeros the op adds itself
            pads = part.const(name + ".input_pad", np.array([0, padded - k], np.int64))
            x = part.node(
                "Pad",
                [x, pads, "", part.const(name + ".input_pad_axis", np.array([-1], np.int64))],
                [name + "/x_padded"],
            )[0]
        if attrs.get("glu", 0):  # SwiGLU in the op: lean's product, then the Split, activation and Mul nodes
            layer = out.removesuffix("/glu")
            got = gated_product(part, add_carried_linear(part, x, blocks, name, options), n // 2, "silu", layer)
        else:
            got = add_carried_linear(part, x, blocks, name, options, bias)
        if got != out:
            raise ValueError(f"{node.name}: its output {out!r} is not the export's name for {name!r}")
        replacement[index] = part.nodes
        arrays.update(part.arrays)
        dropped_weights.add(records_name)
    nodes = []
    for index, node in enumerate(old_nodes):
        if index not in dropped_nodes:
            nodes.extend(replacement.get(index, [node]))
    kept = [t for t in graph.initializer if t.name not in dropped_weights]
    nodes, kept = [_copy(n) for n in nodes], [_copy(t) for t in kept]  # still valid once the fields are cleared
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    small = {name: array for name, array in arrays.items() if array.nbytes < INLINE_BYTES}
    large = {name: array for name, array in arrays.items() if name not in small}
    graph.initializer.extend(kept + [numpy_helper.from_array(array, name) for name, array in small.items()])
    graph.initializer.extend(_placeholder(name, array) for name, array in large.items())
    if not any(n.domain == NATIVE_DOMAIN for n in graph.node):
        kept_opsets = [o for o in model.opset_import if o.domain != NATIVE_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept_opsets)
    return large
