"""Build a lean ONNX decoder graph directly from weights.

Why not a traced export (optimum / torch.onnx): a traced graph concatenates the
KV cache every step, keeps attention unfused and carries a wide signature.  On a
2-core laptop CPU that overhead is as large as the int4 matmuls themselves.  The
graph built here uses ONNX Runtime's fused contrib ops instead:

* ``GatherBlockQuantized`` - int4/int8 embedding lookup (the table stays small);
* ``SimplifiedLayerNormalization`` / ``SkipSimplifiedLayerNormalization`` -
  RMSNorm fused with the residual add;
* ``MatMulNBits`` - weight-only int4/int8 matmuls, Q/K/V fused into one and
  gate/up fused into one, biases folded into the op;
* ``GroupQueryAttention`` - rotary embedding + causal GQA over a KV cache that is
  a **shared past/present buffer** of fixed capacity.  The runtime binds the same
  OrtValue as ``past_key_values.*`` input and ``present.*`` output, so no cache
  is ever copied; rolling back after a rejected draft is just a smaller
  ``seqlens_k`` on the next call.

Signature (batch 1):
  inputs  ``input_ids`` int64 [1, S], ``seqlens_k`` int32 [1] (= past + S - 1),
          ``total_sequence_length`` int32 [] (= past + S), ``num_logits`` int64 [1]
          (how many trailing positions get logits: 1 for decoding, γ+1 to verify),
          ``past_key_values.{i}.key|value`` float32 [1, kv_heads, capacity, head_dim];
          with ``tree_attention`` also ``position_ids`` int64 [1, S] (rotary position of each new
          token: its depth in a draft tree) and ``attention_bias`` float32 [1, 1, S, past + S]
          (-inf where a new token must not see another one: siblings in the tree).  GQA's causal
          mask still applies, so a tree laid out parents-first needs only the sibling entries;
          for a plain chain the runtime binds ``arange`` positions and a zero bias (same cost).
  outputs ``logits`` float32 [1, num_logits, V_head] (when a head is built),
          ``hidden_states`` float32 [1, num_logits, hidden] (final-normed; when asked),
          ``present.{i}.key|value`` (same buffers as the past inputs),
          with ``feature_layers`` also ``features`` float32 [1, S, len(layers) * hidden]: the residual
          stream after each listed layer for every new position (EAGLE-3 drafter input; see
          :func:`feature_output`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, set_external_data, uses_external_data

from edge_spec.defaults import DEFAULT_CONTEXT_LENGTH
from edge_spec.export.bundle import activity
from edge_spec.export.gguf.blocks import (
    ACCURACY_LEVEL_KEY,
    NATIVE_DOMAIN,
    CarriedBlocks,
    add_carried_linear,
    add_native_swiglu,
    add_rounded_native,
    coarse_head,
    concat_blocks,
    narrow_to_4bit,
    native_swiglu_takes,
    round_q6k_to_q4k,
    rounded_native_takes,
)
from edge_spec.export.graph.attention_pad import pad_attention
from edge_spec.export.graph.quantize import quantize_blockwise
from edge_spec.export.graph.rope import rope_tables
from edge_spec.export.graph.weights import DecoderWeights, DeferredMatrix, LayerWeights, stacked
from edge_spec.files import new_file_mode

QUANT_BITS = {"int4": 4, "int8": 8, "fp32": None}
EMBEDDING_BITS_WITH_GGUF = 8
OPSET = 21
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class BuildOptions:
    quant: str = "int4"
    block_size: int = 32
    accuracy_level: int = 4  # MatMulNBits: 4 = int8 activations (fast on AVX2/VNNI), 0 = fp32
    context_length: int = DEFAULT_CONTEXT_LENGTH  # rotary tables cover positions [0, context_length)
    head_rows: np.ndarray | None = None  # keep only these LM-head rows (VocabTrim); None = all
    build_head: bool = True  # False: body only, emit hidden_states (SpecVocab scorer runs outside)
    emit_hidden: bool = False  # also output the final-normed hidden states
    tree_attention: bool = False  # position_ids + attention_bias inputs: verify a draft tree in one pass
    attention_pad: bool = (
        False  # attention gets a throw-away query row (see export.graph.attention_pad; needs tree_attention)
    )
    feature_layers: tuple[int, ...] = ()  # also output ``features``: residual stream after these layers
    gguf_blocks: bool = True  # use the GGUF blocks a loader attached (weights.carried) instead of re-quantizing
    carry_exact: bool = False  # carried blocks exactly as GGUF has them (slower; see gguf.blocks.fast_layout)
    carry_narrow: bool = False  # carried 8-bit blocks rounded to 4 bits (the small layout: gguf.blocks.narrow_to_4bit)
    carry_native: bool = False  # carried Q4_K / Q6_K blocks as GGUF's bytes under the native MatMulGGUF op
    #: with ``carry_native``, the layers' carried Q6_K blocks rounded to Q4_K (the compact layout:
    #: gguf.blocks.round_q6k_to_q4k)
    carry_compact: bool = False
    round_native: bool = False  # re-quantized int4 matmuls as Q4_K under MatMulGGUF (blocks.add_rounded_native)
    #: > 0: a carried 8-bit LM head runs at 4 bits and its best ``head_rescore`` rows per position are
    #: scored again from an 8-bit table (the lean layout: :meth:`DecoderGraphBuilder.rescored_logits`)
    head_rescore: int = 0


EXTERNAL_THRESHOLD = 1024  # onnx.save_model's size_threshold: smaller initializers stay in the graph file
_SIZE_OF_BYTES = sys.getsizeof(b"")  # what onnx compares with the threshold is sys.getsizeof(raw_data)


class ExternalData:
    """A graph's external-data file, written an initializer at a time as the graph is built.

    Why: held until ``onnx.save_model``, every initializer of a model is in memory at once, and twice
    (the builder's list, then the graph's copy), besides the float weights they came from.  Written
    here as each is made, an initializer's bytes live as long as the step that made them.  The file,
    offsets and tensor records are those ``onnx.save_model(..., save_as_external_data=True,
    all_tensors_to_one_file=True, size_threshold=1024)`` writes for the same initializers in the same
    order (:func:`save_model` appends any it finds still in memory, as onnx would)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.location = self.path.name
        self.path.unlink(missing_ok=True)
        self._file = open(self.path, "wb")

    def store(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        """``tensor``, its bytes appended to the file and replaced by their place there when it is as
        large as onnx would store outside the graph."""
        if tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= EXTERNAL_THRESHOLD:
            offset = self._file.tell()
            self._file.write(tensor.raw_data)
            set_external_data(tensor, self.location, offset, self._file.tell() - offset)
            tensor.ClearField("raw_data")
        return tensor

    def array(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        """The initializer ``name`` of ``array``: :meth:`store` of ``numpy_helper.from_array(array, name)``,
        with a large plain array's bytes written from the array itself (no bytes copy of it)."""
        plain = array.dtype.kind in "fiub" and array.dtype.byteorder in ("=", "|", "<") and sys.byteorder == "little"
        if not plain or _SIZE_OF_BYTES + array.nbytes < EXTERNAL_THRESHOLD:
            return self.store(numpy_helper.from_array(array, name))
        tensor = onnx.TensorProto()
        tensor.dims.extend(array.shape)
        if name:
            tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        offset = self._file.tell()
        self._file.write(memoryview(np.ascontiguousarray(array)).cast("B"))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", offset), ("length", array.nbytes)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        return tensor

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ExternalData:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Graph:
    """Accumulates nodes and initializers in creation order (the order they get in the model); with
    ``data``, each initializer's bytes go to that file as it is made (:class:`ExternalData`)."""

    def __init__(self, data: ExternalData | None = None) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.data = data

    def const(self, name: str, array: np.ndarray) -> str:
        array = np.ascontiguousarray(array)
        if self.data is None:
            self.initializers.append(numpy_helper.from_array(array, name))
        else:
            self.initializers.append(self.data.array(name, array))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> list[str]:
        self.nodes.append(helper.make_node(op, inputs, outputs, name=outputs[0] + "/" + op, domain=domain, **attrs))
        return outputs


def make_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """Wrap ``graph`` in the one opset / IR version pairing all edge-spec graphs share, including the
    ``com.microsoft`` opset import the contrib ops need."""
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)]
    if any(node.domain == NATIVE_DOMAIN for node in graph.node):
        opsets.append(helper.make_opsetid(NATIVE_DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="edge-spec")
    model.ir_version = 10
    return model


def add_linear(
    g: Graph, x: str, weight: np.ndarray, name: str, opt: BuildOptions, bias: np.ndarray | None = None
) -> str:
    """y = x @ weight.T + bias, weight [N, K]: MatMulNBits when quantized, MatMul (+Add) in fp32."""
    bits = QUANT_BITS[opt.quant]
    n, k = weight.shape
    out = name + "/out"
    if bits is None:
        inputs = [x, g.const(name + ".weight", np.asarray(weight, np.float32).T)]
        mm = out if bias is None else name + "/mm"
        g.node("MatMul", inputs, [mm])
        if bias is not None:
            g.node("Add", [mm, g.const(name + ".bias", bias.astype(np.float32))], [out])
        return out
    block_size = row_block_size(k, opt.block_size)  # no padded columns to read
    q = quantize_blockwise(weight, bits, block_size)
    inputs = [x, g.const(name + ".qweight", q.packed), g.const(name + ".scales", q.scales.reshape(-1))]
    if bias is not None:
        inputs += ["", "", g.const(name + ".bias", bias.astype(np.float32))]
    g.node(
        "MatMulNBits",
        inputs,
        [out],
        domain=MS_DOMAIN,
        K=k,
        N=n,
        bits=bits,
        block_size=block_size,
        accuracy_level=opt.accuracy_level,
    )
    return out


def row_block_size(width: int, block_size: int) -> int:
    """The largest block of at most ``block_size`` that divides ``width`` (16 at least): a gathered row
    comes out of ``GatherBlockQuantized`` as whole blocks, so a wider block would lengthen every
    embedding, and a matmul would read zero-padded columns on every call (SpecVocab's rank-192 scorer
    at 128: a third more)."""
    size = block_size
    while size > 16 and width % size:
        size //= 2
    return size


def softcap(g: Graph, x: str, cap: float | None, name: str) -> str:
    """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping); ``x`` itself without a cap."""
    if not cap:
        return x
    c = g.const(name + ".softcap", np.array(cap, np.float32))
    scaled = g.node("Div", [x, c], [name + "/capped_in"])[0]
    return g.node("Mul", [g.node("Tanh", [scaled], [name + "/tanh"])[0], c], [name + "/capped"])[0]


def _pass_through(names: tuple[str, ...], graph_name: str) -> onnx.GraphProto:
    """A subgraph (``If`` branch) that outputs the outer graph's tensors ``names`` unchanged."""
    outs = [n + "/" + graph_name for n in names]
    nodes = [helper.make_node("Identity", [n], [o]) for n, o in zip(names, outs)]
    return helper.make_graph(
        nodes, graph_name, [], [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs]
    )


class _Rounded(Mapping):
    """Carried blocks rounded once more as each is asked for: by default the 8-bit ones to 4 bits
    (:func:`narrow_to_4bit`, the small layout)."""

    def __init__(self, carried: Mapping, rounding: Callable[[str, object], object] | None = None) -> None:
        """``rounding(name, blocks)``: another rounding, by the matrix's name (the compact layout's)."""
        self._carried = carried
        self._rounding = rounding or (lambda name, blocks: narrow_to_4bit(blocks))

    def __getitem__(self, name: str):
        return self._rounding(name, self._carried[name])

    def __iter__(self):
        return iter(self._carried)

    def __len__(self) -> int:
        return len(self._carried)


def _compact(name: str, blocks: CarriedBlocks | None) -> CarriedBlocks | None:
    """A layer's carried Q6_K blocks rounded to Q4_K (:func:`round_q6k_to_q4k`); the LM head, ranked in Q4_K
    blocks and scored again from its own, and every other matrix as carried."""
    return blocks if blocks is None or name == "lm_head" else round_q6k_to_q4k(blocks)


def _scaled(table, scale: np.float32):
    """``table`` times ``scale`` in float32; a deferred table stays deferred (scaled a band at a time)."""
    if not isinstance(table, DeferredMatrix):
        return table.astype(np.float32) * scale
    return DeferredMatrix(table.shape, lambda: np.asarray(table) * scale, lambda a, b: table.rows(a, b) * scale)


@dataclass(frozen=True)
class Residual:
    """The residual stream as ``total + pending``.

    A sublayer's output is left *pending* rather than added at once, because the next
    ``SkipSimplifiedLayerNormalization`` adds it while it norms: the add never costs a node of
    its own.  ``pending`` is None only before the first sublayer (the embeddings alone).
    """

    total: str
    pending: str | None = None


class DecoderGraphBuilder:
    """Turns :class:`DecoderWeights` into an ONNX ``ModelProto`` with the signature above.

    :meth:`build` is the whole decoder; the parts it is made of (embedding, decoder layer,
    attention, MLP, norm, outputs) are methods of their own so that other graphs over the same
    weights layout - a draft head of a projection, one layer, a norm and an LM head - are
    assembled from the same parts and export the same ops.  A builder builds one graph.
    """

    def __init__(self, weights: DecoderWeights, options: BuildOptions, data: ExternalData | None = None) -> None:
        if options.quant not in QUANT_BITS:
            raise ValueError(f"quant must be one of {sorted(QUANT_BITS)}")
        self.w = weights
        self.cfg = weights.config
        self.opt = options
        self.bits = QUANT_BITS[options.quant]
        self.carried = weights.carried if options.gguf_blocks and self.bits is not None else {}
        if options.carry_narrow:  # before fusing: a narrowed V then shares Q's and K's layout
            self.carried = _Rounded(self.carried)
        elif options.carry_compact:  # the layers' only: the LM head is ranked in Q4_K blocks either way
            self.carried = _Rounded(self.carried, _compact)
        self.graph = Graph(data)
        self.inputs: list[onnx.ValueInfoProto] = []
        self.present_outputs: list[onnx.ValueInfoProto] = []  # after the graph's own outputs
        self.tree_inputs: list[str] = []  # GQA inputs 9 and 10 when tree_attention
        self._rotary_made: dict[str, tuple[str, str]] = {}

    # -- building blocks -------------------------------------------------------------------------

    def linear(
        self, x: str, weight: np.ndarray | list[tuple[str, np.ndarray]], name: str, bias: np.ndarray | None = None
    ) -> str:
        """``x @ W.T + bias`` with W one weight or the row-wise concatenation of named parts (a fused
        Q/K/V or gate/up projection).  Parts whose GGUF blocks are carried (``weights.carried``) keep
        them: one matmul for each run of neighbouring parts carried in one layout (a Q4_K query and key
        beside a Q6_K value are two, not three: every matmul node costs a step time of its own, and the
        4-bit parts share one computation of the correction's block sums), the outputs concatenated."""
        parts = weight if isinstance(weight, list) else [(name, weight)]
        carried = [self.carried.get(part) for part, _ in parts]
        if not any(c is not None for c in carried):
            full = parts[0][1] if len(parts) == 1 else stacked([w for _, w in parts])
            if self.rounds_native(full):
                return add_rounded_native(self.graph, x, full, name, bias)
            return add_linear(self.graph, x, full, name, self.opt, bias)
        runs = _layout_runs(carried)
        if len(runs) == 1:
            return add_carried_linear(self.graph, x, concat_blocks(carried), name, self.opt, bias)
        row_starts = np.cumsum([0] + [w.shape[0] for _, w in parts])  # each part's first output row
        outs = []
        for start, stop in runs:
            run_name = _run_name([part for part, _ in parts[start:stop]])
            run_bias = None if bias is None else bias[row_starts[start] : row_starts[stop]]
            if carried[start] is None:
                outs.append(add_linear(self.graph, x, parts[start][1], run_name, self.opt, run_bias))
            else:
                blocks = concat_blocks(carried[start:stop])
                outs.append(add_carried_linear(self.graph, x, blocks, run_name, self.opt, run_bias))
        return self.graph.node("Concat", outs, [name + "/out"], axis=-1)[0]

    def step_inputs(self, token_inputs: list[onnx.ValueInfoProto] | None = None) -> None:
        """Declare the per-call inputs every graph with a KV cache takes (the cache inputs
        themselves are declared layer by layer, by :meth:`kv_cache`).  ``token_inputs`` replace
        ``input_ids`` for graphs fed something else per position (an EAGLE head takes embeddings
        and hidden states)."""
        if token_inputs is None:
            token_inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "sequence"])]
        self.inputs += list(token_inputs) + [
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
            helper.make_tensor_value_info("num_logits", TensorProto.INT64, [1]),
        ]
        if self.opt.tree_attention:
            self.inputs += [
                helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "sequence"]),
                helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT, [1, 1, "sequence", "total"]),
            ]
            self.tree_inputs = ["position_ids", "attention_bias"]

    def embedding(self, ids: str) -> str:
        g = self.graph
        table = self.w.embed
        if self.cfg.embedding_scale != 1.0:  # folded into the table: the same float32 product as a Mul after it
            table = _scaled(table, np.float32(self.cfg.embedding_scale))
        if self.bits is None:
            return g.node("Gather", [g.const("embed.weight", table.astype(np.float32)), ids], ["embeds"])[0]
        # beside carried GGUF blocks the table (which GatherBlockQuantized cannot take over) is rounded at
        # 8 bits: a second rounding all the same, but a lookup, so it costs memory and no bandwidth
        bits = EMBEDDING_BITS_WITH_GGUF if self.carried else self.bits
        block_size = row_block_size(table.shape[1], self.opt.block_size)
        q = quantize_blockwise(table, bits, block_size)
        data = q.packed.reshape(q.n, -1)
        return g.node(
            "GatherBlockQuantized",
            [g.const("embed.qweight", data), ids, g.const("embed.scales", q.scales)],
            ["embeds"],
            domain=MS_DOMAIN,
            gather_axis=0,
            quantize_axis=1,
            block_size=block_size,
            bits=bits,
        )[0]

    def rotary_tables(self) -> tuple[str, str]:
        """cos/sin caches of the global-attention layers (all layers unless the family gives sliding
        layers a rope base of their own: see :meth:`layer_rotary`)."""
        cfg = self.cfg
        return self._rotary("rotary", cfg.rope_theta, cfg.rope_scaling)

    def layer_rotary(self, i: int) -> tuple[str, str]:
        """The cos/sin caches layer ``i`` rotates with (Gemma 3's sliding layers: their own base, unscaled)."""
        cfg = self.cfg
        if cfg.rope_local_theta is not None and i in cfg.sliding_layers:
            return self._rotary("rotary_local", cfg.rope_local_theta, None)
        return self.rotary_tables()

    def _rotary(self, name: str, theta: float, scaling: dict | None) -> tuple[str, str]:
        if name in self._rotary_made:
            return self._rotary_made[name]
        cfg, g = self.cfg, self.graph
        tables = rope_tables(
            cfg.rotary_dim,
            theta,
            scaling,
            self.opt.context_length,
            cfg.max_position_embeddings,
            cfg.original_max_position_embeddings,
        )
        made = (g.const(name + ".cos", tables.short.cos), g.const(name + ".sin", tables.short.sin))
        if tables.long is not None:  # LongRoPE: long factors once the sequence outgrows the pretrained context
            long = (g.const(name + ".long_cos", tables.long.cos), g.const(name + ".long_sin", tables.long.sin))
            switch = g.const(name + ".switch_at", np.array(tables.switch_at, np.int32))
            use_long = g.node("Greater", ["total_sequence_length", switch], [name + "/use_long"])[0]
            made = tuple(
                g.node(
                    "If",
                    [use_long],
                    [name + "/cos", name + "/sin"],
                    then_branch=_pass_through(long, name + "_long"),
                    else_branch=_pass_through(made, name + "_short"),
                )
            )
        self._rotary_made[name] = made
        return made

    def norm(
        self, stream: Residual, gamma: np.ndarray, gamma_name: str, outputs: tuple[str, str, str, str]
    ) -> tuple[str, Residual]:
        """RMSNorm of the stream, folding its pending add in; returns (normed, the stream after it).

        ``outputs`` names the normed value, the op's mean and inverse-std outputs, and the summed
        stream; only the first is used while nothing is pending."""
        g = self.graph
        weight = g.const(gamma_name, (gamma + self.cfg.norm_offset).astype(np.float32))
        eps = self.cfg.rms_norm_eps
        if stream.pending is None:
            normed = g.node("SimplifiedLayerNormalization", [stream.total, weight], [outputs[0]], axis=-1, epsilon=eps)[
                0
            ]
            return normed, stream
        normed, _, _, total = g.node(
            "SkipSimplifiedLayerNormalization",
            [stream.pending, stream.total, weight],
            list(outputs),
            domain=MS_DOMAIN,
            epsilon=eps,
        )
        return normed, Residual(total)

    def kv_cache(self, i: int) -> tuple[str, str, str, str]:
        """Declare layer ``i``'s cache: (past key, past value, present key, present value).  The
        runtime binds one buffer as both past and present, so the names pair up by position."""
        kv_shape = [1, self.cfg.num_kv_heads, "capacity", self.cfg.head_dim]
        names = (f"past_key_values.{i}.key", f"past_key_values.{i}.value", f"present.{i}.key", f"present.{i}.value")
        for name in names[:2]:
            self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, kv_shape))
        for name in names[2:]:
            self.present_outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, kv_shape))
        return names

    def attention(self, i: int, layer: LayerWeights, x: str, rotary: tuple[str, str]) -> str:
        """Self-attention of layer ``i`` over its KV cache: fused QKV projection, GQA, output projection."""
        cfg, p = self.cfg, f"layers.{i}"
        past_k, past_v, pres_k, pres_v = self.kv_cache(i)
        attrs = dict(
            num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads,
            do_rotary=1,
            rotary_interleaved=0,
            scale=float(cfg.attn_scale or 1.0 / np.sqrt(cfg.head_dim)),
        )
        if cfg.attn_logit_softcap:
            attrs["softcap"] = float(cfg.attn_logit_softcap)
        if cfg.sliding_window and i in cfg.sliding_layers:
            attrs["local_window_size"] = int(
                cfg.sliding_window
            )  # keys a query sees, its own included, as in transformers
        attn = self.graph.node(
            "GroupQueryAttention",
            [*self.qkv(i, layer, x), past_k, past_v, "seqlens_k", "total_sequence_length", *rotary, *self.tree_inputs],
            [p + "/attn", pres_k, pres_v],
            domain=MS_DOMAIN,
            **attrs,
        )[0]
        return self.linear(attn, layer.o, p + ".o")

    def qkv(self, i: int, layer: LayerWeights, x: str) -> list[str]:
        """GQA's query/key/value inputs: one packed projection, or (with q/k norms) its three parts
        with q and k normed per head."""
        cfg, g, p = self.cfg, self.graph, f"layers.{i}"
        qkv_b = None
        if layer.q_bias is not None:
            qkv_b = np.concatenate([layer.q_bias, layer.k_bias, layer.v_bias])
        qkv = self.linear(x, [(p + ".q", layer.q), (p + ".k", layer.k), (p + ".v", layer.v)], p + ".qkv", qkv_b)
        if not cfg.qk_norm:
            return [qkv, "", ""]
        sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        q, k, v = g.node(
            "Split",
            [qkv, g.const(p + ".qkv_split", np.array(sizes, np.int64))],
            [p + "/q", p + "/k", p + "/v"],
            axis=-1,
        )
        return [self.head_norm(q, layer.q_norm, p + ".q_norm"), self.head_norm(k, layer.k_norm, p + ".k_norm"), v]

    def head_norm(self, x: str, gamma: np.ndarray, name: str) -> str:
        """RMSNorm over each head's ``head_dim`` channels of ``x`` [1, S, heads * head_dim]."""
        g = self.graph
        heads = g.node(
            "Reshape",
            [x, g.const(name + ".shape", np.array([0, 0, -1, self.cfg.head_dim], np.int64))],
            [name + "/heads"],
        )[0]
        normed = self.norm(Residual(heads), gamma, name, (name + "/normed", "", "", ""))[0]
        return g.node("Reshape", [normed, g.const(name + ".flat", np.array([0, 0, -1], np.int64))], [name + "/out"])[0]

    def mlp(self, i: int, layer: LayerWeights, x: str) -> str:
        """Gated MLP of layer ``i`` (SwiGLU, or GeGLU with the tanh GELU), gate and up fused into one
        matmul (then split), or into one native op that applies the gate too."""
        p = f"layers.{i}"
        prod = self.native_swiglu(x, layer, p)
        if prod is None:
            gate_up = self.linear(x, [(p + ".gate", layer.gate), (p + ".up", layer.up)], p + ".gate_up")
            prod = gated_product(self.graph, gate_up, self.cfg.intermediate_size, self.cfg.mlp_activation, p)
        return self.linear(prod, [(p + ".down", layer.down)], p + ".down")

    def rounds_native(self, weight: np.ndarray, glu: bool = False) -> bool:
        """Whether a weight that is not carried is rounded to Q4_K under the native op (``round_native``)."""
        return self.opt.round_native and self.bits == 4 and rounded_native_takes(weight, glu)

    def native_swiglu(self, x: str, layer: LayerWeights, p: str) -> str | None:
        """SwiGLU as one native ``MatMulGGUF`` where gate and up are GGUF blocks of one type under the native
        op (``gated_product``'s output, from ``blocks.add_native_swiglu``), or are rounded to Q4_K for it
        (``round_native``), else None."""
        if self.cfg.mlp_activation != "silu":
            return None
        carried = [self.carried.get(p + ".gate"), self.carried.get(p + ".up")]
        if all(c is None for c in carried) and self.opt.round_native:
            both = stacked([layer.gate, layer.up])
            if self.rounds_native(both, glu=True):
                return add_rounded_native(self.graph, x, both, p + ".gate_up", glu=True, out=gated_product_name(p))
            return None
        if not self.opt.carry_native or any(c is None for c in carried):
            return None
        if len(_layout_runs(carried)) != 1 or not native_swiglu_takes(blocks := concat_blocks(carried)):
            return None
        return add_native_swiglu(self.graph, x, blocks, p + ".gate_up", gated_product_name(p))

    def decoder_layer(self, i: int, layer: LayerWeights, stream: Residual, rotary: tuple[str, str]) -> Residual:
        """One pre-norm decoder layer; its MLP output is left pending on the returned stream.  With
        sandwich norms (Gemma) each sublayer's output is normed before it joins the stream."""
        p = f"layers.{i}"
        normed, stream = self.norm(
            stream, layer.input_norm, p + ".input_norm", (p + "/norm1", p + "/n1_mean", p + "/n1_inv", p + "/resid1")
        )
        attn = self.attention(i, layer, normed, rotary)
        if layer.attn_out_norm is not None:
            attn = self.norm(
                Residual(attn), layer.attn_out_norm, p + ".attn_out_norm", (p + "/attn_normed", "", "", "")
            )[0]
        stream = Residual(stream.total, attn)
        normed, stream = self.norm(
            stream, layer.post_norm, p + ".post_norm", (p + "/norm2", p + "/n2_mean", p + "/n2_inv", p + "/resid2")
        )
        out = self.mlp(i, layer, normed)
        if layer.mlp_out_norm is not None:
            out = self.norm(Residual(out), layer.mlp_out_norm, p + ".mlp_out_norm", (p + "/mlp_normed", "", "", ""))[0]
        return Residual(stream.total, out)

    def final_norm(self, stream: Residual) -> str:
        return self.norm(
            stream, self.w.final_norm, "final_norm", ("final/norm", "final/mean", "final/inv", "final/resid")
        )[0]

    def last_positions(self, x: str) -> str:
        """The trailing ``num_logits`` positions of ``x``: only those need the (large) LM head."""
        g = self.graph
        neg = g.node("Neg", ["num_logits"], ["logits_start"])[0]
        return g.node(
            "Slice",
            [
                x,
                neg,
                g.const("slice.end", np.array([np.iinfo(np.int64).max], np.int64)),
                g.const("slice.axis", np.array([1], np.int64)),
            ],
            ["last_hidden"],
        )[0]

    def logits_output(self, x: str) -> onnx.ValueInfoProto:
        """The LM head (only the ``head_rows`` of it when VocabTrim asks) as output ``logits``."""
        head, carried = self.w.lm_head, self.carried.get("lm_head")
        if self.opt.head_rows is not None:
            head = head[np.asarray(self.opt.head_rows)]
            carried = None if carried is None else carried.rows(np.asarray(self.opt.head_rows))
        if carried is None:
            out = self.linear(x, head, "lm_head")
        elif self.opt.head_rescore and carried.bits == 8 and self.opt.head_rows is None:
            coarse_blocks = coarse_head(carried, self.opt.carry_native)
            coarse = add_carried_linear(self.graph, x, coarse_blocks, "lm_head", self.opt)
            out = self.rescored_logits(x, coarse, head)
        else:
            out = add_carried_linear(self.graph, x, carried, "lm_head", self.opt)
        logits = softcap(self.graph, out, self.cfg.final_logit_softcap, "lm_head")
        self.graph.node("Identity", [logits], ["logits"])
        return helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "num_logits", head.shape[0]])

    def rescored_logits(self, x: str, coarse: str, head) -> str:
        """``coarse`` (the LM head at 4 bits) with each position's ``head_rescore`` best rows replaced by
        their dot products with an 8-bit copy of the head.

        Why: decoding streams every weight once a token, and an 8-bit LM head is the largest single
        share of a Q4_K_M model's bytes (233M weights on Qwen2.5-1.5B).  At 4 bits its ranking is right
        nearly everywhere, but its logits are coarse; the few rows that decide greedy choices, the top
        of the distribution and most of a sampled token's probability are read again from 8-bit rows
        (a gather of ``k`` rows, not a pass over the table).  A tied head shares the embedding's table;
        an untied one brings an 8-bit copy, which costs disk and memory but no bandwidth.  Every step
        is per row: a row's logits do not depend on the other rows of its pass."""
        g = self.graph
        k = min(self.opt.head_rescore, head.shape[0])
        top = g.node(
            "TopK",
            [coarse, g.const("lm_head.rescore_k", np.array([k], np.int64))],
            ["lm_head/top_logits", "lm_head/top_ids"],
            axis=-1,
            largest=1,
            sorted=1,
        )[1]
        table, scales, block_size = self._rescore_table(head)
        rows = g.node(
            "GatherBlockQuantized",
            [table, top, scales],
            ["lm_head/top_rows"],
            domain=MS_DOMAIN,
            gather_axis=0,
            quantize_axis=1,
            block_size=block_size,
            bits=8,
        )[0]
        last = g.const("lm_head.last_axis", np.array([-1], np.int64))
        column = g.node("Unsqueeze", [x, last], ["lm_head/x_column"])[0]
        exact = g.node("MatMul", [rows, column], ["lm_head/top_exact_column"])[0]
        exact = g.node("Squeeze", [exact, last], ["lm_head/top_exact"])[0]
        return g.node("ScatterElements", [coarse, top, exact], ["lm_head/rescored"], axis=-1)[0]

    def _rescore_table(self, head) -> tuple[str, str, int]:
        """The 8-bit table the re-scored rows are gathered from: the embedding's own when the head is
        tied to an unscaled embedding (:meth:`embedding` made it), else one of its own."""
        block_size = row_block_size(head.shape[1], self.opt.block_size)
        shares = head is self.w.embed and self.cfg.embedding_scale == 1.0 and self.carried
        if shares and "embed.qweight" in {i.name for i in self.graph.initializers}:
            return "embed.qweight", "embed.scales", block_size
        q = quantize_blockwise(head, 8, block_size)
        g = self.graph
        return (
            g.const("lm_head.rows8", q.packed.reshape(q.n, -1)),
            g.const("lm_head.rows8_scales", q.scales),
            block_size,
        )

    def hidden_output(self, x: str) -> onnx.ValueInfoProto:
        """``x`` as output ``hidden_states``, for heads that run outside this graph."""
        self.graph.node("Identity", [x], ["hidden_states"])
        shape = [1, "num_logits", self.cfg.hidden_size]
        return helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, shape)

    def features_output(self, layers: tuple[int, ...]) -> onnx.ValueInfoProto:
        """The residual stream after ``layers`` as output ``features`` (see :func:`feature_output`);
        call it after the final norm, whose summed stream is the last layer's feature."""
        node, info = feature_output(layers, len(self.w.layers), self.cfg.hidden_size)
        produced = {name for n in self.graph.nodes for name in n.output}
        missing = [name for name in node.input if name not in produced]
        if missing:
            raise ValueError(f"feature tensors {missing} are not in the graph (build the layers and final norm first)")
        self.graph.nodes.append(node)
        return info

    def to_model(self, outputs: list[onnx.ValueInfoProto], name: str) -> onnx.ModelProto:
        """The model of everything added so far; the KV cache outputs follow ``outputs``."""
        g = self.graph
        return make_model(helper.make_graph(g.nodes, name, self.inputs, outputs + self.present_outputs, g.initializers))

    # -- whole graph -----------------------------------------------------------------------------

    def build(self) -> onnx.ModelProto:
        self.step_inputs()
        activity.detail("the embedding table")
        stream = Residual(self.embedding("input_ids"))
        for i, layer in enumerate(self.w.layers):
            activity.detail(f"layer {i + 1} of {len(self.w.layers)}")
            stream = self.decoder_layer(i, layer, stream, self.layer_rotary(i))
        last = self.last_positions(self.final_norm(stream))
        outputs = []
        if self.opt.build_head:
            activity.detail("the LM head")
            outputs.append(self.logits_output(last))
        if self.opt.emit_hidden or not self.opt.build_head:
            outputs.append(self.hidden_output(last))
        if self.opt.feature_layers:
            outputs.append(self.features_output(tuple(self.opt.feature_layers)))
        model = self.to_model(outputs, "edge_spec_decoder")
        if self.opt.carry_native:  # where the native op cannot run, its nodes become MatMulNBits at this level
            model.metadata_props.append(
                onnx.StringStringEntryProto(key=ACCURACY_LEVEL_KEY, value=str(self.opt.accuracy_level))
            )
        return pad_attention(model) if self.opt.attention_pad else model


FEATURES = "features"


def feature_tensor(layer: int, num_layers: int) -> str:
    """Name of the residual stream after decoder layer ``layer`` (0-based) in a decoder graph.

    A layer's MLP output is only added to the stream by the *next* fused norm, so the full hidden
    state after layer ``l`` (attention and MLP included) exists as the summed-stream output
    (``input_skip_bias_sum``, 4th output) of layer ``l + 1``'s input norm, or of the final norm
    after the last layer: exposing it costs no node of its own."""
    if not 0 <= layer < num_layers:
        raise ValueError(f"feature layer {layer} is out of range for a {num_layers}-layer decoder")
    return f"layers.{layer + 1}/resid1" if layer + 1 < num_layers else "final/resid"


def feature_output(layers, num_layers: int, hidden_size: int) -> tuple[onnx.NodeProto, onnx.ValueInfoProto]:
    """The ``Concat`` node and graph output ``features`` [1, S, len(layers) * hidden]: the residual
    stream after each of ``layers`` (in the listed order) for **all** S new positions - prefill
    needs a feature for every prompt position, not only the ``num_logits`` that get logits.
    Shared by :class:`DecoderGraphBuilder` and the in-place upgrade of exported graphs, so both
    produce the same node."""
    layers = [int(layer) for layer in layers]
    if not layers:
        raise ValueError("feature_layers is empty")
    inputs = [feature_tensor(layer, num_layers) for layer in layers]
    node = helper.make_node("Concat", inputs, [FEATURES], name=FEATURES + "/Concat", axis=-1)
    info = helper.make_tensor_value_info(FEATURES, TensorProto.FLOAT, [1, "sequence", len(layers) * hidden_size])
    return node, info


def _linear_chain(
    weights: list[np.ndarray], options: BuildOptions, graph_name: str, output: str, blocks=None, data=None
) -> onnx.ModelProto:
    """``hidden_states [1, n, H] -> output [1, n, rows]`` through a chain of (quantized) linear maps; a
    single map may come as carried GGUF ``blocks`` instead of being quantized here."""
    g = Graph(data)
    x = "hidden_states"
    for i, weight in enumerate(weights):
        name = f"linear{i}" if len(weights) > 1 else "lm_head"
        if blocks is not None and options.gguf_blocks and QUANT_BITS[options.quant] is not None:
            x = add_carried_linear(g, x, narrow_to_4bit(blocks) if options.carry_narrow else blocks, name, options)
        else:
            x = add_linear(g, x, weight, name, options)
    g.node("Identity", [x], [output])
    graph = helper.make_graph(
        g.nodes,
        graph_name,
        [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, "num_logits", weights[0].shape[1]])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, "num_logits", weights[-1].shape[0]])],
        g.initializers,
    )
    return make_model(graph)


def build_head(weight: np.ndarray, options: BuildOptions, blocks=None, data=None) -> onnx.ModelProto:
    """A stand-alone LM head ``hidden_states [1, n, H] -> logits [1, n, rows]`` (drafter heads:
    full, VocabTrim subsets), quantized like the decoder so its weight reads shrink with it, or its
    GGUF ``blocks`` (the same rows) carried."""
    return _linear_chain([weight], options, "edge_spec_head", "logits", blocks, data)


def build_scorer(w_down: np.ndarray, w_vocab: np.ndarray, options: BuildOptions, data=None) -> onnx.ModelProto:
    """SpecVocab's low-rank scorer ``hidden_states [1, n, H] -> scores [1, n, V]`` = W_vocab (W_down h)."""
    return _linear_chain([w_down, w_vocab], options, "edge_spec_specvocab_scorer", "scores", data=data)


def build_decoder(weights: DecoderWeights, options: BuildOptions, data: ExternalData | None = None) -> onnx.ModelProto:
    """Build the decoder graph for ``weights`` (see module docstring for the signature); ``data``: the
    external-data file its initializers are written to as they are made (see :func:`write_model`)."""
    return DecoderGraphBuilder(weights, options, data).build()


def write_model(path, build: Callable[[ExternalData], onnx.ModelProto]) -> None:
    """Build a graph with ``build(data)``, its initializers written to ``path``'s external-data file as
    they are made, then save the graph to ``path``: the files :func:`save_model` writes for the same
    model, without the model's weights in memory at once."""
    path = Path(path)
    with ExternalData(path.parent / (path.name + ".data")) as data:
        model = build(data)
    save_model(model, path)


def save_model(model: onnx.ModelProto, path) -> None:
    """Save with all weights in one external-data file beside the graph (models exceed 2 GB protobufs).
    Initializers written to that file already (:class:`ExternalData`) stay where they are; any other
    large one is appended to it."""
    path = Path(path)
    data_name = path.name + ".data"
    written = [t for t in model.graph.initializer if uses_external_data(t)]
    if not written:
        (path.parent / data_name).unlink(missing_ok=True)
    elif any(ExternalDataInfo(t).location != data_name for t in written):
        raise ValueError(f"{path.name}: initializers were written to another file than {data_name}")
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=1024,
    )
    if (path.parent / data_name).exists():  # onnx creates it 0600 whatever the umask
        os.chmod(path.parent / data_name, new_file_mode())


def gated_product_name(p: str) -> str:
    """The output of layer ``p``'s gated product, however it is computed."""
    return p + "/glu"


def gated_product(g: Graph, gate_up: str, width: int, activation: str, p: str) -> str:
    """act(gate) * up from ``gate_up`` [.., 2 × ``width``], the gates first: SwiGLU, or GeGLU with the tanh
    GELU (``activation`` "gelu_tanh")."""
    split = g.const(p + ".split", np.array([width] * 2, dtype=np.int64))
    gate, up = g.node("Split", [gate_up, split], [p + "/gate", p + "/up"], axis=-1)
    if activation == "gelu_tanh":
        act = g.node("Gelu", [gate], [p + "/gelu"], approximate="tanh")[0]
    else:
        sig = g.node("Sigmoid", [gate], [p + "/sig"])[0]
        act = g.node("Mul", [gate, sig], [p + "/silu"])[0]
    return g.node("Mul", [act, up], [gated_product_name(p)])[0]


def _layout_runs(carried: list) -> list[tuple[int, int]]:
    """``[start, stop)`` of each run of neighbouring parts that one matmul can take: carried parts of one
    bits/block layout together, every part without carried blocks alone."""
    runs: list[tuple[int, int]] = []
    for i, c in enumerate(carried):
        if runs and c is not None and (prev := carried[runs[-1][0]]) is not None:
            if (prev.bits, prev.block_size) == (c.bits, c.block_size):
                runs[-1] = (runs[-1][0], i + 1)
                continue
        runs.append((i, i + 1))
    return runs


def _run_name(names: list[str]) -> str:
    """One node name for neighbouring parts of a projection: ``layers.3.q`` and ``layers.3.k`` make
    ``layers.3.qk``."""
    if len(names) == 1:
        return names[0]
    prefix = names[0].rsplit(".", 1)[0]
    return prefix + "." + "".join(n.rsplit(".", 1)[-1] for n in names)
