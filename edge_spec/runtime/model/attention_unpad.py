"""A target graph without its attention pad, in memory: what the pad costs, measured on the same file.

The exporter gives the target's attention a throw-away query row (``edge_spec.export.graph.attention_pad``) so
that a one-row pass takes ``GroupQueryAttention``'s multi-query path and rounds as multi-row passes do.
Where the matmul kernels have a one-row path of their own (``row_invariance``), one-row passes are not
exact with the pad either, and it still doubles the attention of a one-row pass (after 2,000 tokens of
context, 27 of a 155 ms step on a 2-core AVX2 CPU).  The runtime keeps it there all the same, because
without it one-row logits part further from multi-row ones (docs/methods/exact-verification.md);
``benchmarks/studies/attention_pad_cost.py`` loads the graph both ways to price that choice.
"""

from __future__ import annotations

import onnx

ATTENTION_PAD_KEY = "edge_spec.attention_pad"  # graph metadata "1": the graph pads its attention
PAD_PREFIX = "attention_pad/"  # the name of every node and constant the pad shares between layers
_REPLACING = {"Concat", "Add", "Pad"}  # pad nodes whose output stands for their first input, one row longer


def has_attention_pad(model: onnx.ModelProto) -> bool:
    return any(p.key == ATTENTION_PAD_KEY and p.value == "1" for p in model.metadata_props)


def strip_attention_pad(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as it was before the exporter padded its attention (in place; returned for chaining).
    A graph without the pad is returned unchanged."""
    if not has_attention_pad(model):
        return model
    graph = model.graph
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    padded_rows = {f"{n.name}/pad{i}" for n in attention for i in range(3)}
    cut_for = {n.input[0]: n for n in graph.node if n.op_type == "Slice" and n.name.endswith("/cut")}

    def added(node: onnx.NodeProto) -> bool:
        name = node.name.removesuffix("/last_row")
        return name.startswith(PAD_PREFIX) or name in padded_rows

    original = {}  # a padded tensor -> the tensor it pads
    for node in graph.node:
        if added(node) and node.op_type in _REPLACING:
            original[node.output[0]] = node.input[0]
    cuts = set()
    for node in attention:
        for index, name in enumerate(node.input):
            node.input[index] = original.get(name, name)
        cut = cut_for.get(node.output[0])  # cuts the padded output back to the real rows
        if cut is not None:
            node.output[0] = cut.output[0]
            cuts.add(cut.name)
    kept = [n for n in graph.node if not added(n) and n.name not in cuts]
    del graph.node[:]
    graph.node.extend(kept)
    constants = [t for t in graph.initializer if not t.name.startswith(PAD_PREFIX)]
    del graph.initializer[:]
    graph.initializer.extend(constants)
    metadata = [p for p in model.metadata_props if p.key != ATTENTION_PAD_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(metadata)
    return model
