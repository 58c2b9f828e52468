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
          ``present.{i}.key|value`` (same buffers as the past inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edge_spec.export.quantize import quantize_blockwise
from edge_spec.export.weights import DecoderWeights

QUANT_BITS = {"int4": 4, "int8": 8, "fp32": None}
OPSET = 21
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class BuildOptions:
    quant: str = "int4"
    block_size: int = 32
    accuracy_level: int = 4  # MatMulNBits: 4 = int8 activations (fast on AVX2/VNNI), 0 = fp32
    context_length: int = 4096  # rotary tables cover positions [0, context_length)
    head_rows: np.ndarray | None = None  # keep only these LM-head rows (VocabTrim); None = all
    build_head: bool = True  # False: body only, emit hidden_states (SpecVocab scorer runs outside)
    emit_hidden: bool = False  # also output the final-normed hidden states
    tree_attention: bool = False  # position_ids + attention_bias inputs: verify a draft tree in one pass


class _Graph:
    """Small helper that accumulates nodes and initializers with unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> list[str]:
        self.nodes.append(helper.make_node(op, inputs, outputs, name=outputs[0] + "/" + op, domain=domain, **attrs))
        return outputs


def _make_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
        producer_name="edge-spec",
    )
    model.ir_version = 10
    return model


def add_linear(g: _Graph, x: str, weight: np.ndarray, name: str, opt: BuildOptions,
               bias: np.ndarray | None = None) -> str:
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
    q = quantize_blockwise(weight, bits, opt.block_size)
    inputs = [x, g.const(name + ".qweight", q.packed), g.const(name + ".scales", q.scales.reshape(-1))]
    if bias is not None:
        inputs += ["", "", g.const(name + ".bias", bias.astype(np.float32))]
    g.node(
        "MatMulNBits", inputs, [out], domain=MS_DOMAIN,
        K=k, N=n, bits=bits, block_size=opt.block_size, accuracy_level=opt.accuracy_level,
    )
    return out


class DecoderGraphBuilder:
    """Turns :class:`DecoderWeights` into an ONNX ``ModelProto`` with the signature above."""

    def __init__(self, weights: DecoderWeights, options: BuildOptions) -> None:
        if options.quant not in QUANT_BITS:
            raise ValueError(f"quant must be one of {sorted(QUANT_BITS)}")
        self.w = weights
        self.cfg = weights.config
        self.opt = options
        self.bits = QUANT_BITS[options.quant]
        self.g = _Graph()

    # -- building blocks -------------------------------------------------------------------------

    def linear(self, x: str, weight: np.ndarray, name: str, bias: np.ndarray | None = None) -> str:
        return add_linear(self.g, x, weight, name, self.opt, bias)

    def embedding(self, ids: str) -> str:
        g = self.g
        table = self.w.embed
        if self.bits is None:
            return g.node("Gather", [g.const("embed.weight", table.astype(np.float32)), ids], ["embeds"])[0]
        q = quantize_blockwise(table, self.bits, self.opt.block_size)
        data = q.packed.reshape(q.n, -1)
        return g.node(
            "GatherBlockQuantized",
            [g.const("embed.qweight", data), ids, g.const("embed.scales", q.scales)],
            ["embeds"], domain=MS_DOMAIN,
            gather_axis=0, quantize_axis=1, block_size=self.opt.block_size, bits=self.bits,
        )[0]

    def rotary_tables(self) -> tuple[str, str]:
        cfg = self.cfg
        inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
        freqs = np.outer(np.arange(self.opt.context_length, dtype=np.float64), inv_freq)
        return (
            self.g.const("rotary.cos", np.cos(freqs).astype(np.float32)),
            self.g.const("rotary.sin", np.sin(freqs).astype(np.float32)),
        )

    # -- whole graph -----------------------------------------------------------------------------

    def build(self) -> onnx.ModelProto:
        cfg, g = self.cfg, self.g
        eps = cfg.rms_norm_eps
        cos, sin = self.rotary_tables()
        kv_shape = [1, cfg.num_kv_heads, "capacity", cfg.head_dim]
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "sequence"]),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
            helper.make_tensor_value_info("num_logits", TensorProto.INT64, [1]),
        ]
        tree_inputs: list[str] = []  # GQA inputs 9 and 10
        if self.opt.tree_attention:
            inputs += [
                helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "sequence"]),
                helper.make_tensor_value_info("attention_bias", TensorProto.FLOAT, [1, 1, "sequence", "total"]),
            ]
            tree_inputs = ["position_ids", "attention_bias"]
        outputs = []
        present_outputs = []

        hidden = self.embedding("input_ids")
        residual = None
        mlp_out = None
        for i, layer in enumerate(self.w.layers):
            p = f"layers.{i}"
            gamma = g.const(p + ".input_norm", layer.input_norm.astype(np.float32))
            if residual is None:
                normed = g.node("SimplifiedLayerNormalization", [hidden, gamma], [p + "/norm1"], axis=-1, epsilon=eps)[0]
                residual = hidden
            else:
                normed, _, _, residual = g.node(
                    "SkipSimplifiedLayerNormalization", [mlp_out, residual, gamma],
                    [p + "/norm1", p + "/n1_mean", p + "/n1_inv", p + "/resid1"], domain=MS_DOMAIN, epsilon=eps,
                )
            qkv_w = np.concatenate([layer.q, layer.k, layer.v], axis=0)
            qkv_b = None
            if layer.q_bias is not None:
                qkv_b = np.concatenate([layer.q_bias, layer.k_bias, layer.v_bias])
            qkv = self.linear(normed, qkv_w, p + ".qkv", qkv_b)

            past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
            pres_k, pres_v = f"present.{i}.key", f"present.{i}.value"
            for name in (past_k, past_v):
                inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, kv_shape))
            for name in (pres_k, pres_v):
                present_outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, kv_shape))
            attn = g.node(
                "GroupQueryAttention",
                [qkv, "", "", past_k, past_v, "seqlens_k", "total_sequence_length", cos, sin, *tree_inputs],
                [p + "/attn", pres_k, pres_v], domain=MS_DOMAIN,
                num_heads=cfg.num_heads, kv_num_heads=cfg.num_kv_heads, do_rotary=1, rotary_interleaved=0,
                scale=float(1.0 / np.sqrt(cfg.head_dim)),
            )[0]
            o = self.linear(attn, layer.o, p + ".o")
            gamma2 = g.const(p + ".post_norm", layer.post_norm.astype(np.float32))
            normed2, _, _, residual = g.node(
                "SkipSimplifiedLayerNormalization", [o, residual, gamma2],
                [p + "/norm2", p + "/n2_mean", p + "/n2_inv", p + "/resid2"], domain=MS_DOMAIN, epsilon=eps,
            )
            gate_up = self.linear(normed2, np.concatenate([layer.gate, layer.up], axis=0), p + ".gate_up")
            split = g.const(p + ".split", np.array([cfg.intermediate_size] * 2, dtype=np.int64))
            gate, up = g.node("Split", [gate_up, split], [p + "/gate", p + "/up"], axis=-1)
            sig = g.node("Sigmoid", [gate], [p + "/sig"])[0]
            act = g.node("Mul", [gate, sig], [p + "/silu"])[0]
            prod = g.node("Mul", [act, up], [p + "/swiglu"])[0]
            mlp_out = self.linear(prod, layer.down, p + ".down")

        final_gamma = g.const("final_norm", self.w.final_norm.astype(np.float32))
        final = g.node(
            "SkipSimplifiedLayerNormalization", [mlp_out, residual, final_gamma],
            ["final/norm", "final/mean", "final/inv", "final/resid"], domain=MS_DOMAIN, epsilon=eps,
        )[0]
        neg = g.node("Neg", ["num_logits"], ["logits_start"])[0]
        last = g.node(
            "Slice",
            [final, neg, g.const("slice.end", np.array([np.iinfo(np.int64).max], np.int64)),
             g.const("slice.axis", np.array([1], np.int64))],
            ["last_hidden"],
        )[0]
        if self.opt.build_head:
            head = self.w.lm_head
            if self.opt.head_rows is not None:
                head = head[np.asarray(self.opt.head_rows)]
            logits = self.linear(last, head, "lm_head")
            g.node("Identity", [logits], ["logits"])
            outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "num_logits", head.shape[0]]))
        if self.opt.emit_hidden or not self.opt.build_head:
            g.node("Identity", [last], ["hidden_states"])
            outputs.append(
                helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, "num_logits", cfg.hidden_size])
            )
        graph = helper.make_graph(g.nodes, "edge_spec_decoder", inputs, outputs + present_outputs, g.initializers)
        return _make_model(graph)


def _linear_chain(weights: list[np.ndarray], options: BuildOptions, graph_name: str, output: str) -> onnx.ModelProto:
    """``hidden_states [1, n, H] -> output [1, n, rows]`` through a chain of (quantized) linear maps."""
    g = _Graph()
    x = "hidden_states"
    for i, weight in enumerate(weights):
        x = add_linear(g, x, weight, f"linear{i}" if len(weights) > 1 else "lm_head", options)
    g.node("Identity", [x], [output])
    graph = helper.make_graph(
        g.nodes, graph_name,
        [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, "num_logits", weights[0].shape[1]])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, "num_logits", weights[-1].shape[0]])],
        g.initializers,
    )
    return _make_model(graph)


def build_head(weight: np.ndarray, options: BuildOptions) -> onnx.ModelProto:
    """A stand-alone LM head ``hidden_states [1, n, H] -> logits [1, n, rows]`` (drafter heads:
    full, VocabTrim subsets), quantized like the decoder so its weight reads shrink with it."""
    return _linear_chain([weight], options, "edge_spec_head", "logits")


def build_scorer(w_down: np.ndarray, w_vocab: np.ndarray, options: BuildOptions) -> onnx.ModelProto:
    """SpecVocab's low-rank scorer ``hidden_states [1, n, H] -> scores [1, n, V]`` = W_vocab (W_down h)."""
    return _linear_chain([w_down, w_vocab], options, "edge_spec_specvocab_scorer", "scores")


def build_decoder(weights: DecoderWeights, options: BuildOptions) -> onnx.ModelProto:
    """Build the decoder graph for ``weights`` (see module docstring for the signature)."""
    return DecoderGraphBuilder(weights, options).build()


def save_model(model: onnx.ModelProto, path) -> None:
    """Save with all weights in one external-data file beside the graph (models exceed 2 GB protobufs)."""
    from pathlib import Path

    path = Path(path)
    data_name = path.name + ".data"
    (path.parent / data_name).unlink(missing_ok=True)
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
        location=data_name, size_threshold=1024,
    )
