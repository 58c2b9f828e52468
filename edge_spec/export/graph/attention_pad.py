"""Give a decoder graph's attention a throw-away query row, so that one-token passes can be exact.

Why: greedy speculative decoding is bit-identical to target-only decoding only if every position's
logits are a function of the token sequence alone, whatever number of rows shared its pass.  ONNX
Runtime's ``GroupQueryAttention`` has a one-query path that rounds differently from its multi-query
path, so the runtime used to pad every one-token pass with a second token (``Decoder.min_rows = 2``),
which also pays a second row through every matmul.  Where the
matmul kernels are themselves row-invariant (measured per machine:
:mod:`edge_spec.runtime.model.row_invariance`), padding the attention alone is enough, and it costs one
query row of attention.

The rewrite touches the graph file only (weights stay in their external ``.data`` file, not even
read).  Each ``GroupQueryAttention`` node gets its query/key/value rows with a copy of the last row
appended, the sequence and position inputs grown by one to match, and its output cut back to the
real rows.  The copy's key and value land one slot past the sequence (the runtime's cache keeps one
spare slot for them), which causal attention hides from every real row, and the next pass overwrites.
The copy keeps the last row's rotary position; the rotary tables get one more row all the same (a copy
of their last, folded at load), because attention wants as many as the padded sequence is long.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.model.attention_unpad import ATTENTION_PAD_KEY as PAD_KEY
from edge_spec.runtime.model.attention_unpad import PAD_PREFIX as _PREFIX
from edge_spec.runtime.model.attention_unpad import has_attention_pad

_INPUTS = ("seqlens_k", "total_sequence_length", "position_ids", "attention_bias")
_ROTARY_TABLES = (7, 8)  # GroupQueryAttention's cos and sin cache inputs
_AXIS = {1: _PREFIX + "rows_axis", 0: _PREFIX + "table_axis"}  # [1, S, ...] rows; a rotary table's rows


def pad_attention(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every attention fed one throw-away query row (in place; returned for chaining).

    Only graphs with the tree inputs (``position_ids``, ``attention_bias``: the target) are taken, so
    that the pad row's rotary position is given, not derived from a sequence one longer than the
    tables.  A graph padded already is returned unchanged."""
    if has_attention_pad(model):
        return model
    graph = model.graph
    names = {i.name for i in graph.input}
    if not set(_INPUTS) <= names:
        raise EdgeSpecError(
            "only a target graph with tree-attention inputs can pad its attention; re-export the bundle"
        )
    if not any(n.op_type == "GroupQueryAttention" for n in graph.node):
        raise EdgeSpecError("this graph has no GroupQueryAttention node to pad")
    shared, padded_input = _padded_step_inputs()
    nodes: list[onnx.NodeProto] = list(shared)
    tables: dict[str, str] = {}
    for original in graph.node:
        node = onnx.NodeProto()
        node.CopyFrom(original)
        if node.op_type == "GroupQueryAttention":
            before, after = _pad_node(node, padded_input, tables)
            nodes += [*before, node, after]
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(_constants())
    model.metadata_props.append(onnx.StringStringEntryProto(key=PAD_KEY, value="1"))
    return model


def add_attention_pad(onnx_path: Path | str) -> bool:
    """Rewrite an exported graph file in place (written beside it, then renamed over it); returns
    whether it changed (False: padded already)."""
    from edge_spec.files import write_atomic

    path = Path(onnx_path)
    if not path.is_file():
        raise EdgeSpecError(f"ONNX model not found: {path}")
    model = onnx.load(str(path), load_external_data=False)
    if has_attention_pad(model):
        return False
    write_atomic(path, lambda tmp: onnx.save_model(pad_attention(model), tmp))
    return True


def _constants() -> list[onnx.TensorProto]:
    return [
        numpy_helper.from_array(np.array([1], np.int32), _PREFIX + "one"),
        numpy_helper.from_array(np.array(1, np.int32), _PREFIX + "one_scalar"),
        numpy_helper.from_array(np.array([-1], np.int64), _PREFIX + "last"),
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), _PREFIX + "end"),
        numpy_helper.from_array(np.array([0], np.int64), _PREFIX + "start"),
        *(numpy_helper.from_array(np.array([axis], np.int64), name) for axis, name in _AXIS.items()),
        numpy_helper.from_array(np.array([0, 0, 0, 0, 0, 0, 1, 1], np.int64), _PREFIX + "bias_pads"),
    ]


def _with_last_row(x: str, out: str, axis: int = 1) -> list[onnx.NodeProto]:
    """``out`` = ``x`` with its last row along ``axis`` appended once more."""
    last = out + "/last_row"
    return [
        helper.make_node("Slice", [x, _PREFIX + "last", _PREFIX + "end", _AXIS[axis]], [last], name=last),
        helper.make_node("Concat", [x, last], [out], name=out, axis=axis),
    ]


def _padded_step_inputs() -> tuple[list[onnx.NodeProto], dict[str, str]]:
    """The per-pass inputs attention sees, one row longer: built once, shared by every layer."""
    p = {name: _PREFIX + name for name in _INPUTS}
    nodes = [
        helper.make_node("Add", ["seqlens_k", _PREFIX + "one"], [p["seqlens_k"]], name=p["seqlens_k"]),
        helper.make_node(
            "Add",
            ["total_sequence_length", _PREFIX + "one_scalar"],
            [p["total_sequence_length"]],
            name=p["total_sequence_length"],
        ),
        *_with_last_row("position_ids", p["position_ids"]),
        # one more key column (the pad's own slot: causal masking hides it from the real rows) and one
        # more query row (the pad's, attending to everything before it)
        helper.make_node(
            "Pad",
            ["attention_bias", _PREFIX + "bias_pads"],
            [p["attention_bias"]],
            name=p["attention_bias"],
            mode="constant",
        ),
    ]
    return nodes, p


def _pad_node(
    node: onnx.NodeProto, padded_input: dict[str, str], tables: dict[str, str]
) -> tuple[list[onnx.NodeProto], onnx.NodeProto]:
    """Rewire ``node`` to padded rows and inputs; returns the nodes that pad its query/key/value rows
    and, the first time a rotary table is seen, that table (``tables``: padded so far; all go before
    ``node``), and the slice that cuts its output back to the real rows (to go after it)."""
    before: list[onnx.NodeProto] = []
    for index in range(3):  # packed QKV, or query, key and value
        name = node.input[index] if index < len(node.input) else ""
        if name:
            padded = f"{node.name}/pad{index}"
            before += _with_last_row(name, padded)
            node.input[index] = padded
    for index, name in enumerate(node.input):
        if index in _ROTARY_TABLES and name:  # GQA wants as many table rows as the padded sequence is long
            if name not in tables:
                tables[name] = _PREFIX + name
                before += _with_last_row(name, tables[name], axis=0)
            node.input[index] = tables[name]
        elif name in padded_input:
            node.input[index] = padded_input[name]
    real = node.output[0]
    node.output[0] = real + "/padded"
    cut = helper.make_node(
        "Slice",
        [node.output[0], _PREFIX + "start", _PREFIX + "last", _PREFIX + "rows_axis"],
        [real],
        name=real + "/cut",
    )
    return before, cut


def pad_bundle_target(bundle_dir: Path | str) -> bool:
    """Give a bundle exported before targets padded their attention that pad: its target graph is
    rewritten (weights untouched) and the manifest's record of it updated; on any failure the bundle
    is left as it was.  Returns whether it changed."""
    from edge_spec.manifest import read_manifest, rerecord_file, write_manifest

    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    target = manifest["target"]
    graph = bundle_dir / target["onnx"]
    backup = graph.read_bytes()
    try:
        if not add_attention_pad(graph):
            return False
        rerecord_file(bundle_dir, target, target["onnx"])
        write_manifest(bundle_dir, manifest)
    except BaseException:
        graph.write_bytes(backup)
        raise
    return True
