"""Run the last layer's row-wise tail only for the rows whose logits a pass returns, in memory, at load time.

A pass returns logits for its last ``num_logits`` rows, and the exported graph cuts those rows out just before
the LM head (a ``Slice`` from ``-num_logits``).  Every key and value the pass writes comes from the attention
of each layer, so the last layer's output projection, MLP and the final norm work on rows nobody reads: when
a 512-token prompt pass asks for one row of logits, that is 511 rows through the last layer's largest
matmuls, about 1/28 of a prompt read of the 1.5B target.  This moves the cut up to where the rows enter
that tail.

Only where the tail's matmuls are the native ``MatMulGGUF`` (the native layout under its op): each row's result
there is the same whatever number of rows shares the call, as it is for the norms, so a cut row's logits keep
their bits.  ONNX Runtime's ``MatMulNBits`` has a one-row path on some CPUs that rounds otherwise, so a lean
graph keeps its cut where it is.
"""

from __future__ import annotations

from collections import defaultdict

import onnx

from edge_spec.runtime.model.native_attention import NATIVE_DOMAIN

# ops whose every output row is computed from the same row of their inputs alone, in the same order whatever
# the rows of the call (MatMulGGUF: on the native op's kernels; the norms: ONNX Runtime's per-row CPU kernels)
_ROW_WISE = {
    ("MatMulGGUF", NATIVE_DOMAIN),
    ("SkipSimplifiedLayerNormalization", "com.microsoft"),
    ("SimplifiedLayerNormalization", ""),
    ("SimplifiedLayerNormalization", "ai.onnx"),
}
SUFFIX = "/last_rows"  # the name of each cut this adds, after the tensor it cuts


def cut_rows_early(model: onnx.ModelProto) -> int:
    """Move the graph's cut to its last ``num_logits`` rows from before the LM head up through the row-wise
    nodes before it (in place); returns how many nodes now see only those rows (0: the graph is left as it
    was: no such cut, or no native matmul behind it)."""
    graph = model.graph
    cut = _logits_cut(graph)
    if cut is None:
        return 0
    readers: dict[str, list[str]] = defaultdict(list)  # tensor -> the first outputs of the nodes reading it
    for node in graph.node:
        for name in node.input:
            readers[name].append(node.output[0])
    outputs = {o.name for o in graph.output}
    tail = {cut.output[0]}  # nodes by their first output; the cut's own readers are past it
    for node in reversed(graph.node):  # a node's readers come after it: they are decided first
        if (node.op_type, node.domain) not in _ROW_WISE or outputs & set(node.output):
            continue
        read = [name for name in node.output if name and readers[name]]
        if read and all(reader in tail for name in read for reader in readers[name]):
            tail.add(node.output[0])
    tail.discard(cut.output[0])
    nodes = list(graph.node)
    inside = [n for n in nodes if n.output[0] in tail]
    if not any(n.op_type == "MatMulGGUF" for n in inside):
        return 0
    known = {name for node in inside for name in node.output} | {t.name for t in graph.initializer}
    entering = sorted({name for node in inside for name in node.input if name and name not in known})
    for node in inside:
        for index, name in enumerate(node.input):
            if name in entering:
                node.input[index] = name + SUFFIX
    first = next(i for i, n in enumerate(nodes) if n.output[0] in tail)
    cuts = [
        onnx.helper.make_node("Slice", [name, *cut.input[1:]], [name + SUFFIX], name=name + SUFFIX) for name in entering
    ]
    nodes[first:first] = cuts
    del graph.node[:]
    graph.node.extend(nodes)
    return len(inside)


def _logits_cut(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The ``Slice`` that keeps the last ``num_logits`` rows (its start ``Neg(num_logits)``), or None."""
    negated = {n.output[0] for n in graph.node if n.op_type == "Neg" and list(n.input) == ["num_logits"]}
    cuts = [n for n in graph.node if n.op_type == "Slice" and len(n.input) >= 4 and n.input[1] in negated]
    return cuts[0] if len(cuts) == 1 else None
