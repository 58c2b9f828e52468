"""A second graph of a decoder (the target's, the drafter's) that reads prompts through int8 matmuls: several
times faster on long prompts.

Why: reading a prompt is compute-bound, and ``MatMulNBits`` (the decode graph's int4 kernel, bound by the
bytes a one-row step streams) reads 512 prompt rows about as fast as a float32 ``MatMul``.  ONNX Runtime's
int8 GEMM (MLAS QGEMM: VNNI, and AMX where the CPU has it) is several times faster there
(``benchmarks/studies/prefill_kernels.py``, ``int8_prompt_path.py``).

The prompt graph is the decoder graph with each layer matmul replaced: the weight as the decode graph computes
it (its blocks dequantized, a folded GGUF correction added back to its columns; for the native layout's
``MatMulGGUF``, GGUF's own Q4_K and Q6_K blocks dequantized) rounded to int8 per output row, and the input
rounded to uint8 around 128 with one scale per row (:func:`int8_matmul_nodes`; matmuls of one input share its
rounding, and the parts a ``Split`` cuts an output into, or a SwiGLU's gate and up rows, are matmuls of their
own).  Per row, because a row's int8 input must not depend on the other rows of its pass: a prompt's keys and
values then do not depend on how the prompt was cut into passes, and the model's massive activations (a few
tokens' values in the down projection's input, hundreds of times the rest) cost only their own row's
precision.  Everything else (embedding, norms, attention, the LM head and its re-scoring) is the decoder's own:
the prompt graph's shared weights point into the decoder's data file, and only the int8 weights are new.

The decode graph still computes every decoded and verified token, so speculative decoding stays lossless:
greedy output equals the target's own for the same prompt.  What changes is what "the target" is: a prompt
read this way gets keys and values from other kernels than the same tokens decoded one by one, so an answer
may differ from the one the decode graph alone gives (at near-ties; docs/methods/prompt-reader.md measures
how often).  Hence the prompt reader is an export option, not the default.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from edge_spec.export.gguf.blocks import NATIVE_DOMAIN
from edge_spec.export.gguf.interleaved import deinterleave, record_width
from edge_spec.export.graph.builder import MS_DOMAIN, ExternalData
from edge_spec.files import new_file_mode

PROMPT_STEM = "prompt"
_SHARED = "int8/"  # the name prefix of the constants every replaced matmul shares
_SUMS_FEEDERS = ("Pad", "ReduceSum", "Reshape")  # the block-sum chain of a folded correction (gguf.blocks)


class _Initializers:
    """A graph's initializers as arrays, read one at a time (a weight file stays on disk: mapped, not loaded)."""

    def __init__(self, graph: onnx.GraphProto, folder: Path) -> None:
        self._tensors = {t.name: t for t in graph.initializer}
        self._folder = folder
        self._maps: dict[str, np.memmap] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        if not uses_external_data(tensor):
            return numpy_helper.to_array(tensor)
        info = ExternalDataInfo(tensor)
        if info.location not in self._maps:
            self._maps[info.location] = np.memmap(self._folder / info.location, np.uint8, "r")
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        raw = self._maps[info.location][info.offset : info.offset + info.length]
        return raw.view(dtype).reshape(tuple(tensor.dims))


def dequantized(node: onnx.NodeProto, arrays: _Initializers) -> np.ndarray:
    """A ``MatMulNBits`` node's weight [N, K] in float32 (K as the node reads it: folded columns included)."""
    attrs = {a.name: a.i for a in node.attribute}
    n, k, bits, block = attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"]
    scales = np.asarray(arrays[node.input[2]], np.float32).reshape(n, -1)
    blocks = scales.shape[1]
    packed = np.asarray(arrays[node.input[1]]).reshape(n, blocks, -1)
    has_zero = len(node.input) > 3 and node.input[3] != ""
    if bits == 4:
        codes = np.empty((n, blocks, block), np.uint8)
        codes[..., 0::2], codes[..., 1::2] = packed & 15, packed >> 4
        zero = np.full((n, blocks), 8, np.float32)
        if has_zero:
            nibbles = np.asarray(arrays[node.input[3]]).reshape(n, -1)
            zero = np.stack([nibbles & 15, nibbles >> 4], -1).reshape(n, -1)[:, :blocks].astype(np.float32)
    elif bits == 8:
        codes = packed
        zero = np.full((n, blocks), 128, np.float32)
        if has_zero:
            zero = np.asarray(arrays[node.input[3]]).reshape(n, blocks).astype(np.float32)
    else:
        raise ValueError(f"{node.name}: {bits}-bit MatMulNBits is not read here")
    weight = (codes.astype(np.float32) - zero[..., None]) * scales[..., None]
    return weight.reshape(n, -1)[:, :k]


def _folded_input(node: onnx.NodeProto, producers: dict, arrays: _Initializers):
    """For a matmul fed ``[x, sums, 0, sums, 0]`` (``fold_correction``): (x, K of x, block size, digits,
    the nodes that built its input); None for a matmul fed ``x`` itself."""
    concat = producers.get(node.input[0])
    if concat is None or concat.op_type != "Concat" or len(concat.input) < 2:
        return None
    chain, sums = [concat], concat.input[1]
    while sums in producers and producers[sums].op_type in _SUMS_FEEDERS:
        chain.append(producers[sums])
        sums = producers[sums].input[0]
    reshape = chain[-1]
    if reshape.op_type != "Reshape" or sums != concat.input[0]:
        return None
    shape = np.asarray(arrays[reshape.input[1]])
    return concat.input[0], int(shape[2] * shape[3]), int(shape[3]), len(concat.input) - 1, chain


def effective_weight(node: onnx.NodeProto, producers: dict, arrays: _Initializers):
    """(weight [N, K] as the decode graph computes ``x @ weight.T``, x, the block-sum nodes it no longer needs):
    a folded correction's digits multiply x's block sums, which is the same as adding each digit to every
    column of its block."""
    weight = dequantized(node, arrays)
    folded = _folded_input(node, producers, arrays)
    if folded is None:
        return weight, node.input[0], []
    x, k, block, digits, chain = folded
    width = (weight.shape[1] - k) // digits
    effective = weight[:, :k].copy()
    for digit in range(digits):
        start = k + digit * width
        effective += np.repeat(weight[:, start : start + k // block], block, axis=1)
    return effective, x, chain


def native_weight(node: onnx.NodeProto, arrays: _Initializers) -> np.ndarray:
    """A ``MatMulGGUF`` node's weight [N, K] in float32: its records turned back into GGUF's bytes and
    dequantized by the ``gguf`` package (the values the native op multiplies by; for ``glu=1`` the gate rows,
    then the up rows)."""
    from gguf import GGMLQuantizationType, quants

    attrs = {a.name: a.i for a in node.attribute}
    n, k = attrs["N"], attrs["K"]
    raw = deinterleave(np.asarray(arrays[node.input[1]]), attrs["type"], n, record_width(k), attrs.get("tail", 8))
    weight = np.asarray(quants.dequantize(raw, GGMLQuantizationType(attrs["type"])), np.float32).reshape(n, -1)
    return weight[:, :k]  # rows of a narrower input end in zeros (``blocks.add_rounded_native``)


def _layer_matmul(node: onnx.NodeProto, producers: dict, arrays: _Initializers):
    """(weight [N, K], x, nodes it no longer needs, whether it is a SwiGLU) for a layer's matmul node, else None:
    the LM head reads one row a prompt, and the decode graph's kernel is right for it."""
    if not node.name.startswith("layers."):
        return None
    if node.op_type == "MatMulNBits":
        return *effective_weight(node, producers, arrays), False
    if node.op_type == "MatMulGGUF" and node.domain == NATIVE_DOMAIN:
        glu = any(a.name == "glu" and a.i for a in node.attribute)
        return native_weight(node, arrays), node.input[0], [], glu
    return None


def swiglu_nodes(p: str, gate: str, up: str, y: str) -> list[onnx.NodeProto]:
    """``y = silu(gate) * up``, as the native op's ``glu=1`` computes it after its two products."""
    make = helper.make_node
    return [
        make("Sigmoid", [gate], [p + "/sig"]),
        make("Mul", [gate, p + "/sig"], [p + "/silu"]),
        make("Mul", [p + "/silu", up], [y]),
    ]


def int8_rows(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output row: (codes [K, N] as ``MatMulInteger`` takes them, scales [N])."""
    scale = np.abs(weight).max(1) / 127
    scale[scale == 0] = 1
    codes = np.rint(weight / scale[:, None])
    return codes.astype(np.int8).T.copy(), scale.astype(np.float32)


#: the constants every replaced matmul's nodes share (:func:`int8_matmul_nodes`)
SHARED_CONSTANTS = {
    _SHARED + "axes": np.array([-1], np.int64),
    _SHARED + "levels": np.array(127, np.float32),
    _SHARED + "least_step": np.array(1e-30, np.float32),
    _SHARED + "offset": np.array(128, np.float32),
    _SHARED + "zero": np.array(128, np.uint8),
    _SHARED + "one": np.array(1, np.float32),
    _SHARED + "nought": np.array(0, np.float32),
}


def row_rounding_nodes(p: str, x: str, k: int) -> list[onnx.NodeProto]:
    """``p/codes``: x [.., K] rounded to uint8 around 128 at one scale per row (``p/step``).

    One blocked ``QuantizeLinear`` (one block of ``k`` per row) rounds the rows: a third of the time of dividing,
    rounding, shifting and casting in four nodes, the same codes."""
    make = helper.make_node
    return [
        make("Abs", [x], [p + "/abs"]),
        make("ReduceMax", [p + "/abs", _SHARED + "axes"], [p + "/peak"], keepdims=1),
        make("Div", [p + "/peak", _SHARED + "levels"], [p + "/step0"]),
        make("Max", [p + "/step0", _SHARED + "least_step"], [p + "/step"]),
        make("Mul", [p + "/step", _SHARED + "nought"], [p + "/zero0"]),  # 128 in the step's shape, per row
        make("Add", [p + "/zero0", _SHARED + "offset"], [p + "/zero1"]),
        make("Cast", [p + "/zero1"], [p + "/zero"], to=TensorProto.UINT8),
        make("QuantizeLinear", [x, p + "/step", p + "/zero"], [p + "/codes"], axis=-1, block_size=k),
    ]


def int8_product_nodes(p: str, rows: str, codes: str, scales: str, y: str) -> list[onnx.NodeProto]:
    """``y``: the rows rounded by :func:`row_rounding_nodes` (prefix ``rows``) times W (int8 per column).
    ``MatMulIntegerToFloat`` applies W's scales as its GEMM writes the result (a separate ``Cast`` and ``Mul``
    over the int32 result cost half as much again), then one ``Mul`` applies the rows'."""
    make = helper.make_node
    return [
        make(
            "MatMulIntegerToFloat",
            [rows + "/codes", codes, _SHARED + "one", scales, _SHARED + "zero"],
            [p + "/columns"],
            domain=MS_DOMAIN,
        ),
        make("Mul", [p + "/columns", rows + "/step"], [y]),
    ]


def int8_matmul_nodes(name: str, x: str, k: int, codes: str, scales: str, y: str) -> list[onnx.NodeProto]:
    """``y = x @ W`` with x [.., K] rounded to uint8 around 128 at one scale per row and W int8 per column."""
    p = name + "/int8"
    return row_rounding_nodes(p, x, k) + int8_product_nodes(p, p, codes, scales, y)


def _split_after(node: onnx.NodeProto, consumers: dict, arrays: "_Initializers") -> tuple | None:
    """(the ``Split`` node that alone reads ``node``'s output along its last axis, its part widths), if any:
    the parts can then be computed as matmuls of their own, and nothing copies them apart."""
    readers = consumers.get(node.output[0], [])
    if len(readers) != 1 or readers[0].op_type != "Split" or len(readers[0].input) < 2:
        return None
    split = readers[0]
    axis = next((a.i for a in split.attribute if a.name == "axis"), 0)
    if axis != -1:
        return None
    return split, [int(w) for w in np.asarray(arrays[split.input[1]])]


def write_prompt_graph(target: Path, out: Path | None = None) -> Path:
    """Derive the prompt graph of the target graph file ``target`` (see module docstring) and write it beside
    it (``prompt.onnx`` and ``prompt.onnx.data``); returns its path.  One weight is dequantized at a time."""
    target = Path(target)
    out = Path(out) if out is not None else target.with_name(PROMPT_STEM + ".onnx")
    if out.parent != target.parent:
        raise ValueError("the prompt graph's shared weights are read from the target's folder: write it there")
    model = onnx.load(str(target), load_external_data=False)
    graph = model.graph
    arrays = _Initializers(graph, target.parent)
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    replaced: dict[str, list[onnx.NodeProto]] = {}
    unneeded: set[str] = set()
    rounded: dict[str, str] = {}  # a matmul input -> the prefix of its rounded rows (query and value share one)
    with ExternalData(out.with_name(out.name + ".data")) as data:
        constants = [data.array(name, value) for name, value in SHARED_CONSTANTS.items()]
        for node in graph.node:
            found = _layer_matmul(node, producers, arrays)
            if found is None:
                continue
            weight, x, chain, glu = found
            unneeded.update(n.name for n in chain)
            codes, scales = int8_rows(weight)
            weight_k = weight.shape[1]
            del weight
            base = node.output[0]
            nodes: list[onnx.NodeProto] = []
            if x not in rounded:
                rounded[x] = base + "/int8"
                nodes += row_rounding_nodes(rounded[x], x, weight_k)
            has_bias = node.op_type == "MatMulNBits" and len(node.input) > 5 and node.input[5] != ""
            split = None if has_bias or glu else _split_after(node, consumers, arrays)
            if glu:  # the gate and up products, then silu(gate) * up where the op wrote it
                half = codes.shape[1] // 2
                parts = [(f"{base}.part0", base + "/gate", 0, half), (f"{base}.part{half}", base + "/up", half, half)]
            elif split is None:  # one product, biased after it where the matmul has a bias
                parts = [(base, base + "/unbiased" if has_bias else base, 0, codes.shape[1])]
            else:  # each part its own product, written where the Split wrote it
                split_node, widths = split
                unneeded.add(split_node.name)
                starts = np.cumsum([0] + widths[:-1])
                parts = [(f"{base}.part{s}", out, s, w) for s, out, w in zip(starts, split_node.output, widths)]
            for name, y, start, width in parts:
                constants += [
                    data.array(name + ".int8", np.ascontiguousarray(codes[:, start : start + width])),
                    data.array(name + ".int8_scales", scales[start : start + width]),
                ]
                nodes += int8_product_nodes(name + "/int8", rounded[x], name + ".int8", name + ".int8_scales", y)
            if has_bias:
                nodes.append(helper.make_node("Add", [parts[0][1], node.input[5]], [base], name=base + "/bias"))
            if glu:
                nodes += swiglu_nodes(base + "/int8", parts[0][1], parts[1][1], base)
            replaced[node.name] = nodes
    nodes = [m for n in graph.node if n.name not in unneeded for m in replaced.get(n.name, [n])]
    used = {i for n in nodes for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]  # shared: they point into the target's data file
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + constants)
    if not any(o.domain == "" and o.version >= 21 for o in model.opset_import):  # blocked QuantizeLinear
        raise ValueError("the decoder graph's opset is too old for a prompt graph (blocked QuantizeLinear needs 21)")
    onnx.save_model(model, str(out))
    out.chmod(new_file_mode())
    return out
