"""Run a decoder graph's attention on the native op (``edge_spec.native``), in memory, at load time.

ORT's CPU ``GroupQueryAttention`` reads each key/value head once per query head sharing it (six times for
Qwen2.5's 12 over 2), and its one-row path rounds differently from its multi-row one.  The native op
takes the same inputs, outputs and attributes, reads each key/value head once and gives a query row the
same bits whatever number of rows shares its pass.  The bundle's file is left as it is: the loaded graph's
attention nodes move to the native op's domain, and a graph the native op cannot take (or a machine where
it does not build, or ``EDGE_SPEC_NATIVE_ATTENTION=0``) keeps ORT's op.  CPU execution provider only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import onnx
from onnx import TensorProto

from edge_spec.native import build

log = logging.getLogger(__name__)

NATIVE_DOMAIN = "ai.edge_spec"
ORT_DOMAIN = "com.microsoft"
_MAX_INPUTS = 11  # query, key, value, past key/value, seqlens_k, total, cos, sin, position_ids, attention_bias
_UNSUPPORTED_ATTRIBUTES = {"smooth_softmax", "qk_output"}


def native_library(provider: str) -> Path | None:
    """The native op's library where this decoder can use it (None: ORT's op stays)."""
    if provider.lower() != "cpu":
        return None
    return build.library_path()


@functools.cache
def prompt_path(library: Path) -> str:
    """The native op's path for a prompt graph's passes on this CPU: "amx" (bfloat16 products on AMX's
    tiles, each block of rows scoring only its causal window), or "" where there is none and ORT's op,
    faster over many rows than the native one-row kernels, stays."""
    return _library_answer(library, "EdgeSpecPromptPath", "")


def _library_answer(library: Path, function: str, default: str) -> str:
    """What the library's ``const char* function()`` says, or ``default`` where it has no such function."""
    try:
        answer = getattr(ctypes.CDLL(str(library)), function)
    except (OSError, AttributeError):
        return default
    answer.restype = ctypes.c_char_p
    return (answer() or default.encode()).decode()


def _takes(node: onnx.NodeProto, float_inputs: set[str]) -> bool:
    if node.op_type != "GroupQueryAttention" or node.domain != ORT_DOMAIN:
        return False
    if len(node.input) > _MAX_INPUTS or len(node.output) != 3 or len(node.input) < 5:
        return False
    if any(a.name in _UNSUPPORTED_ATTRIBUTES and a.i != 0 for a in node.attribute):
        return False
    return node.input[3] in float_inputs and node.input[4] in float_inputs  # an fp32 cache, bound by the runtime


def use_native_attention(model: onnx.ModelProto, bf16_products: bool = False) -> int:
    """Move ``model``'s attention nodes to the native op (in place); returns how many moved.  With
    ``bf16_products`` they take its prompt path (:func:`prompt_path`), for a graph that only reads prompts."""
    graph = model.graph
    float_inputs = {i.name for i in graph.input if i.type.tensor_type.elem_type == TensorProto.FLOAT}
    moved = 0
    for node in graph.node:
        if _takes(node, float_inputs):
            node.domain = NATIVE_DOMAIN
            if bf16_products:
                node.attribute.append(onnx.helper.make_attribute("bf16_products", 1))
            moved += 1
    if moved and not any(o.domain == NATIVE_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(NATIVE_DOMAIN, 1))
    return moved


def all_attention_native(model: onnx.ModelProto) -> bool:
    """Whether every attention node of ``model`` runs on the native op (after :func:`use_native_attention`):
    then no query row takes a one-query path, and a graph's attention pad would only cost its row."""
    nodes = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    return bool(nodes) and all(n.domain == NATIVE_DOMAIN for n in nodes)


KV_INPUT, KV_OUTPUT = "past_key_values.", "present."
#: the ops that stream a quantized weight matrix: ORT's 4- and 8-bit blocks, GGUF's own blocks on the native op
QUANTIZED_MATMULS = ("MatMulNBits", "MatMulGGUF")


def use_half_cache(model: onnx.ModelProto, threads: int) -> bool:
    """Type ``model``'s key/value cache float16 (in place) where every attention node runs on the native op
    (after :func:`use_native_attention`) and nothing else reads the cache; returns whether it did.

    The op rounds each new key and value to float16 as it writes them and reads every tile of the cache back
    exactly into float32 scratch, so a pass reads half the bytes of a float32 cache at the same arithmetic;
    a row's keys and values are rounded before any row of its pass reads them, so passes stay batch-invariant.
    Each block of a pass's rows reads the whole cache back, so the op is told the session's ``threads`` and
    cuts a verify pass into no more blocks than keep them busy (which rows share a block changes no bits).
    Not for a prompt graph's bfloat16 path (which packs the cache itself)."""
    graph = model.graph
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    if not all_attention_native(model) or any(
        a.name == "bf16_products" and a.i for n in attention for a in n.attribute
    ):
        return False
    if not any(n.op_type in QUANTIZED_MATMULS for n in graph.node):
        return False  # a float32 export: the reference against transformers keeps a float32 cache
    cache = {i.name for i in graph.input if i.name.startswith(KV_INPUT)}
    readers = [n for n in graph.node if cache & set(n.input)]
    if not cache or any(n not in attention for n in readers):
        return False
    for value in list(graph.input) + list(graph.output):
        if value.name.startswith((KV_INPUT, KV_OUTPUT)):
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    for node in attention:
        node.attribute.append(onnx.helper.make_attribute("threads", max(1, threads)))
    return True


def gguf_matmul_path(library: Path) -> str:
    """Which kernels the native ``MatMulGGUF`` runs on this CPU: "avx512", "avxvnni" (the AVX2 kernels with
    AVX-VNNI's products), "avx2" or "scalar"."""
    return _library_answer(library, "EdgeSpecGGUFMatMulPath", "scalar")


def gguf_matmul_asks_ahead(library: Path) -> bool:
    """Whether the native ``MatMulGGUF``'s one-row passes ask for the next record ahead of the hardware
    prefetcher on this CPU (Intel's cores, where the prefetcher alone falls behind a one-row pass)."""
    return _library_answer(library, "EdgeSpecGGUFOneRowPrefetch", "none") == "ahead"


def gguf_matmul_far_words(library: Path) -> str:
    """Which of the native ``MatMulGGUF``'s passes ask for records far ahead in this process now: "far" (every
    pass), "far from N rows" or "near" (none)."""
    return _library_answer(library, "EdgeSpecGGUFFarPrefetch", "near")


def native_matmul_route(model: onnx.ModelProto, provider: str) -> tuple[Path | None, str]:
    """Where ``model``'s own native ops (``MatMulGGUF``: a bundle exported with ``--gguf-layout native``) run:
    ``(library, "")`` to register when the native op runs here, ``(None, why)`` when it does not and the
    graph is loaded in the ``lean`` layout's form instead (``edge_spec.export.gguf.native_to_lean``), and
    ``(None, "")`` for a graph without them.  The op's scalar kernels, on a CPU without AVX2, are slower
    than ORT's own, and ``EDGE_SPEC_NATIVE_MATMUL=0`` asks for the lean form everywhere."""
    if not any(n.domain == NATIVE_DOMAIN and n.op_type != "GroupQueryAttention" for n in model.graph.node):
        return None, ""
    return native_matmul_here(provider)


def native_matmul_here(provider: str = "cpu") -> tuple[Path | None, str]:
    """``(library, "")`` where the native ``MatMulGGUF`` runs with ``provider`` on this machine, else ``(None,
    why)`` (see :func:`native_matmul_route`; the exporter's ``--gguf-layout auto`` asks it too)."""
    if os.environ.get("EDGE_SPEC_NATIVE_MATMUL", "1") == "0":
        return None, "EDGE_SPEC_NATIVE_MATMUL=0"
    if provider.lower() != "cpu":
        return None, f"its native op runs on the CPU execution provider only, not {provider}"
    library = build.required_library_path()
    if library is None:
        return None, "the native library does not build here: python -m edge_spec.native.build says why"
    if gguf_matmul_path(library) == "scalar":
        return None, "this CPU has no AVX2, and ONNX Runtime's own kernels are faster than the native op's scalar ones"
    return library, ""


def uses_native_attention(model: onnx.ModelProto) -> bool:
    return any(n.domain == NATIVE_DOMAIN for n in model.graph.node)
