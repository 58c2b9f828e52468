"""What a one-row decode step reads: our target's ``MatMulNBits`` bytes against a peer's ONNX export, by part.

Decoding is memory-bound, so a step's time follows the weight bytes its matmuls stream.  This study splits our
target's bytes per projection into what a plain 4-bit export of the same shapes would read and what the GGUF
carry adds on top: the folded correction's rows (x's block sums appended to x, ``docs/methods/gguf.md``) and the
8-bit blocks Q6_K's parts keep (or, in the native layout, GGUF's own Q6_K blocks under ``MatMulGGUF``).  A peer's export (onnxruntime-genai's model builder: int4, blocks of 32) is
counted the same way, node by node, so the table says which part of our step's extra time is which bytes.  No
model runs: the counts come from the graphs' initializers.

Usage::

    python benchmarks/studies/step_bytes.py [--bundle BUNDLE] [--peer models/genai/NAME/model.onnx]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from edge_spec.export.gguf.interleaved import Q6_K  # noqa: E402
from edge_spec.manifest import read_manifest  # noqa: E402
from edge_spec.paths import DEFAULT_BUNDLE  # noqa: E402
from edge_spec.runtime.model.native_attention import QUANTIZED_MATMULS  # noqa: E402

# onnxruntime-genai's node names ('/model/layers.3/mlp/gate_proj/MatMul_Q4') and ours ('layers.3.gate_up/out/...')
_PEER_ROLE = re.compile(r"/(q_proj|k_proj|v_proj|qkv_proj|o_proj|gate_proj|up_proj|down_proj|lm_head)/")
_OUR_ROLE = re.compile(r"layers\.\d+\.([A-Za-z_]+)/")
_GROUP = {"q": "attention in", "k": "attention in", "v": "attention in", "qk": "attention in",
          "qkv": "attention in", "o": "attention out", "gate": "gate, up", "up": "gate, up",
          "gate_up": "gate, up", "down": "down", "lm_head": "LM head"}  # fmt: skip


def _role(name: str) -> str:
    if "lm_head" in name:
        return "lm_head"
    match = _PEER_ROLE.search(name) or _OUR_ROLE.match(name)
    return match.group(1).removesuffix("_proj") if match else name


def _attributes(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}


def step_bytes(onnx_path: Path) -> dict[str, dict[str, float]]:
    """Per group of projections: MB read a step in all, in correction rows, and in 8-bit matrices."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    size = {
        name: int(np.prod(t.dims)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        for name, t in initializers.items()
    }
    producer = {out: node for node in graph.node for out in node.output}
    groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for node in graph.node:
        if node.op_type not in QUANTIZED_MATMULS:
            continue
        attrs = _attributes(node)
        total = sum(size.get(x, 0) for x in node.input[1:])
        group = _GROUP.get(_role(node.name), "other")
        groups[group]["MB"] += total / 1e6
        if attrs.get("bits") == 8 or attrs.get("type") == Q6_K:
            groups[group]["8-bit MB"] += total / 1e6
        base_k = _input_width(producer.get(node.input[0]), initializers) if "K" in attrs else None
        if base_k and base_k < attrs["K"]:
            groups[group]["correction MB"] += total * (attrs["K"] - base_k) / attrs["K"] / 1e6
    return groups


def _input_width(concat: onnx.NodeProto | None, initializers: dict[str, onnx.TensorProto]) -> int | None:
    """K before the block sums were appended: the width of the Concat's first input, read from the block
    shape our exporter gives the sums' Reshape (``<prefix>.blocks``: [0, 0, blocks, 32])."""
    if concat is None or concat.op_type != "Concat" or not concat.output[0].endswith("/x_and_sums"):
        return None
    blocks = initializers.get(concat.output[0].removesuffix("/x_and_sums") + ".blocks")
    if blocks is None:
        return None
    shape = numpy_helper.to_array(blocks)
    return int(shape[-2] * shape[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument(
        "--peer",
        type=Path,
        default=ROOT / "models" / "genai" / "qwen2.5-coder-1.5b-instruct-q4_k_m" / "model.onnx",
        help="a peer's ONNX export of the same model (default: onnxruntime-genai's, from spec_peers.py --prepare)",
    )
    args = parser.parse_args()
    ours = step_bytes(args.bundle / read_manifest(args.bundle)["target"]["onnx"])
    peer = step_bytes(args.peer) if args.peer.is_file() else {}
    header = f"{'projections':<14} {'ours MB':>9} {'correction':>11} {'8b, Q6_K':>9} {'peer MB':>9} {'ours - peer':>12}"
    print(header)
    print("-" * len(header))
    for group in [*dict.fromkeys(_GROUP.values()), "other"]:
        if group not in ours and group not in peer:
            continue
        o, p = ours.get(group, {}), peer.get(group, {})
        print(
            f"{group:<14} {o.get('MB', 0):9.1f} {o.get('correction MB', 0):11.1f} {o.get('8-bit MB', 0):9.1f} "
            f"{p.get('MB', 0):9.1f} {o.get('MB', 0) - p.get('MB', 0):+12.1f}"
        )
    total = {key: sum(g.get(key, 0) for g in ours.values()) for key in ("MB", "correction MB", "8-bit MB")}
    peer_total = sum(g.get("MB", 0) for g in peer.values())
    print("-" * len(header))
    print(
        f"{'a step':<14} {total['MB']:9.1f} {total['correction MB']:11.1f} {total['8-bit MB']:9.1f} "
        f"{peer_total:9.1f} {total['MB'] - peer_total:+12.1f}"
    )
    if peer_total:
        print(f"ours / peer: {total['MB'] / peer_total:.3f} of the bytes")


if __name__ == "__main__":
    main()
