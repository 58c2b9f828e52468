"""The graph builder's parts assemble graphs other than the decoder: an EAGLE-style draft head.

The head reads token ids and a hidden state from elsewhere (the target's, in EAGLE), projects their
concatenation down to the model width, runs one decoder layer with its own KV cache, then the final
norm and the LM head.  Its PyTorch twin is a one-layer Qwen2 fed ``inputs_embeds`` = that projection,
so every part (embedding, attention, MLP, norm, head, cache) is checked against PyTorch numbers.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from edge_spec.export.graph.builder import BuildOptions, DecoderGraphBuilder, Residual
from edge_spec.export.graph.quantize import quantize_blockwise
from tests import tiny_models

CAPACITY = 16
STEPS = 5  # tokens in the first call; one more follows through the KV cache


def head_graph(builder: DecoderGraphBuilder, fc: np.ndarray) -> onnx.ModelProto:
    """ids + hidden [1, S, H] -> logits of the last ``num_logits`` positions, from the builder's parts."""
    g = builder.graph
    rotary = builder.rotary_tables()
    builder.step_inputs()
    builder.inputs.append(helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "sequence", fc.shape[0]]))
    joined = g.node("Concat", [builder.embedding("input_ids"), "hidden"], ["joined"], axis=-1)[0]
    stream = Residual(builder.linear(joined, fc, "fc"))
    stream = builder.decoder_layer(0, builder.w.layers[0], stream, rotary)
    last = builder.last_positions(builder.final_norm(stream))
    return builder.to_model([builder.logits_output(last)], "eagle_like_head")


def dequantized(array: np.ndarray, quant: str) -> np.ndarray:
    """What a weight is in the graph: its int4 reconstruction, or itself in fp32."""
    return array if quant == "fp32" else quantize_blockwise(array, 4, 32).dequantize()


def torch_reference(model, fc: np.ndarray, ids: np.ndarray, hidden: np.ndarray, quant: str) -> np.ndarray:
    """Logits of the one-layer model over ``fc @ [embed(ids); hidden]``, weights as the graph holds them."""
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.copy_(torch.from_numpy(dequantized(param.numpy(), quant)))
        embeds = model.get_input_embeddings().weight.numpy()[ids]
        projected = np.concatenate([embeds, hidden], axis=-1) @ dequantized(fc, quant).T
        return model(inputs_embeds=torch.from_numpy(projected)[None]).logits[0].numpy()


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_head_assembled_from_parts_matches_pytorch(quant):
    model = tiny_models.make_qwen2(seed=3, layers=1)
    weights = tiny_models.loaded("head", model, tiny_models.make_tokenizer()).weights
    cfg = weights.config
    rng = np.random.default_rng(0)
    fc = (rng.standard_normal((cfg.hidden_size, 2 * cfg.hidden_size)) / np.sqrt(2 * cfg.hidden_size)).astype(np.float32)
    builder = DecoderGraphBuilder(weights, BuildOptions(quant, accuracy_level=0, context_length=CAPACITY))
    graph = head_graph(builder, fc)
    # ORT loading it is the check that counts: onnx.checker knows no SimplifiedLayerNormalization (an ORT
    # op in the default domain, as in the decoder graph)
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])

    ids = rng.integers(0, cfg.vocab_size, STEPS + 1)
    hidden = rng.standard_normal((STEPS + 1, cfg.hidden_size)).astype(np.float32)
    ref = torch_reference(model, fc, ids, hidden, quant)

    cache = {
        f"past_key_values.0.{kind}": np.zeros((1, cfg.num_kv_heads, CAPACITY, cfg.head_dim), np.float32)
        for kind in ("key", "value")
    }

    def run(start: int, stop: int) -> np.ndarray:
        logits, key, value = session.run(
            None,
            {
                "input_ids": ids[None, start:stop],
                "hidden": hidden[None, start:stop],
                "seqlens_k": np.array([stop - 1], np.int32),
                "total_sequence_length": np.array(stop, np.int32),
                "num_logits": np.array([stop - start], np.int64),
                **cache,
            },
        )
        cache.update({"past_key_values.0.key": key, "past_key_values.0.value": value})
        return logits[0]

    tol = 1e-4 if quant == "fp32" else 2e-3
    np.testing.assert_allclose(run(0, STEPS), ref[:STEPS], atol=tol)
    np.testing.assert_allclose(run(STEPS, STEPS + 1), ref[STEPS:], atol=tol)  # through the cache
