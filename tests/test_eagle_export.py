"""EAGLE-3 exporter side: target feature outputs, the head's ONNX graphs, SpecForge checkpoints.

Every ONNX number is checked against PyTorch: the target's features against the Hugging Face
model's layer outputs (captured as SpecForge captures them, with forward hooks), the head graph
against :class:`Eagle3Head`, whose layout is SpecForge's ``LlamaForCausalLMEagle3``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from edge_spec.errors import EdgeSpecError
from edge_spec.export.eagle.model import (
    Eagle3Config,
    Eagle3Head,
    add_feature_output,
    build_eagle_fc,
    build_eagle_head,
    default_feature_layers,
    eagle_head_weights,
    feature_layers_of,
    load_specforge,
    save_specforge,
)
from edge_spec.export.graph.builder import BuildOptions, build_decoder
from edge_spec.export.graph.quantize import quantize_blockwise
from tests import tiny_models
from tests.helpers import random_head, tiny_head_config

CAPACITY = 32
FEATURE_LAYERS = (2, 0, 3)  # unsorted on purpose (concatenation order) and including the last layer


def session(model: onnx.ModelProto | str) -> ort.InferenceSession:
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def dequantized(array: np.ndarray, quant: str) -> np.ndarray:
    """A weight as the graph holds it: its int4 reconstruction, or itself in fp32."""
    return array if quant == "fp32" else quantize_blockwise(array, 4, 32).dequantize()


class Decoder:
    """Runs a decoder graph with the shared past/present cache, chunk by chunk, keeping every output."""

    def __init__(self, model, cfg, capacity: int = CAPACITY) -> None:
        self.session = session(model)
        self.names = [o.name for o in self.session.get_outputs()]
        self.tree = any(i.name == "position_ids" for i in self.session.get_inputs())
        self.feeds = {
            f"past_key_values.{i}.{kind}": np.zeros((1, cfg.num_kv_heads, capacity, cfg.head_dim), np.float32)
            for i in range(cfg.num_layers)
            for kind in ("key", "value")
        }

    def run(self, ids: np.ndarray, start: int, stop: int, num_logits: int) -> dict[str, np.ndarray]:
        feeds = {
            "input_ids": ids[None, start:stop],
            "seqlens_k": np.array([stop - 1], np.int32),
            "total_sequence_length": np.array(stop, np.int32),
            "num_logits": np.array([num_logits], np.int64),
            **self.feeds,
        }
        if self.tree:
            feeds["position_ids"] = np.arange(start, stop, dtype=np.int64)[None]
            feeds["attention_bias"] = np.zeros((1, 1, stop - start, stop), np.float32)
        out = dict(zip(self.names, self.session.run(None, feeds)))
        self.feeds.update(
            {k.replace("present", "past_key_values"): v for k, v in out.items() if k.startswith("present.")}
        )
        return out


def hf_layer_outputs(model, ids: np.ndarray, layers) -> np.ndarray:
    """[S, len(layers) * H]: the outputs of ``layers`` (forward hooks, as SpecForge's HF backend)."""
    captured = {}
    hooks = [
        model.model.layers[layer].register_forward_hook(
            lambda module, args, output, layer=layer: captured.__setitem__(
                layer, output[0] if isinstance(output, tuple) else output
            )
        )
        for layer in set(layers)
    ]
    try:
        with torch.no_grad():
            hidden_states = model(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
    finally:
        for hook in hooks:
            hook.remove()
    for layer in layers:  # hidden_states[l + 1] is layer l's output, except the last (final-normed there)
        if layer + 1 < len(model.model.layers):
            torch.testing.assert_close(captured[layer], hidden_states[layer + 1], rtol=0, atol=0)
    return torch.cat([captured[layer].reshape(len(ids), -1) for layer in layers], dim=-1).numpy()


@pytest.fixture(scope="module")
def tiny_target():
    model = tiny_models.make_qwen2(seed=5, layers=4)
    return model, tiny_models.loaded("target", model, tiny_models.make_tokenizer()).weights


# -- (a) target features -------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_features_are_the_hf_layer_outputs(tiny_target, quant):
    model, weights = tiny_target
    cfg = weights.config
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 9)
    reference = model
    if quant != "fp32":  # the graph's weights are the int4 reconstructions: give PyTorch the same
        reference = tiny_models.make_qwen2(seed=5, layers=4)
        with torch.no_grad():
            for param in reference.parameters():
                if param.ndim == 2:
                    param.copy_(torch.from_numpy(dequantized(param.numpy(), quant)))
    expected = hf_layer_outputs(reference, ids, FEATURE_LAYERS)

    options = BuildOptions(quant, accuracy_level=0, context_length=CAPACITY, feature_layers=FEATURE_LAYERS)
    decoder = Decoder(build_decoder(weights, options), cfg)
    first = decoder.run(ids, 0, 8, num_logits=1)  # features cover every row, not only the num_logits ones
    second = decoder.run(ids, 8, 9, num_logits=1)  # and a decoding step through the cache
    features = np.concatenate([first["features"][0], second["features"][0]])
    assert features.shape == (9, len(FEATURE_LAYERS) * cfg.hidden_size)
    assert first["logits"].shape == (1, 1, cfg.vocab_size)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(features, expected, rtol=0, atol=(2e-6 if quant == "fp32" else 2e-5) * scale)


@pytest.mark.parametrize("quant", ["int4", "fp32"])
def test_feature_output_leaves_logits_bit_identical(tiny_target, quant):
    _, weights = tiny_target
    options = BuildOptions(quant, context_length=CAPACITY, tree_attention=True)  # as the exported target
    plain = Decoder(build_decoder(weights, options), weights.config)
    featured = Decoder(
        build_decoder(weights, dataclasses.replace(options, feature_layers=FEATURE_LAYERS)), weights.config
    )
    assert featured.names == ["logits", "features"] + plain.names[1:]
    ids = np.random.default_rng(2).integers(0, weights.config.vocab_size, 12)
    for start, stop, num_logits in ((0, 7, 7), (7, 8, 1), (8, 12, 4)):
        a, b = plain.run(ids, start, stop, num_logits), featured.run(ids, start, stop, num_logits)
        for name in plain.names:
            assert np.array_equal(a[name], b[name]), name


def test_feature_layers_out_of_range_are_refused(tiny_target):
    _, weights = tiny_target
    with pytest.raises(ValueError, match="feature layer 4 is out of range"):
        build_decoder(weights, BuildOptions("fp32", context_length=CAPACITY, feature_layers=(0, 4)))


def test_default_feature_layers_follow_specforge():
    assert default_feature_layers(28) == (1, 13, 24)  # Qwen2.5 1.5B
    assert default_feature_layers(32) == (1, 15, 28)  # Llama 3.1 8B (SGLang captures before 2, 16, 29)
    with pytest.raises(EdgeSpecError, match="too shallow"):
        default_feature_layers(4)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_add_feature_output_upgrades_an_exported_target(tmp_path, tiny_pair):
    from tests.conftest import export_tiny

    tokenizer, target, _ = tiny_pair
    bundle = export_tiny(tmp_path / "bundle", tiny_pair, quant="int4")
    path = bundle / "target" / "model.onnx"
    data_hash = sha256(bundle / "target" / "model.onnx.data")
    weights = tiny_models.loaded("t", target, tokenizer).weights
    cfg = weights.config
    layers = (1, 0)
    assert feature_layers_of(path) is None

    add_feature_output(path, layers)
    assert feature_layers_of(path) == layers
    assert sha256(bundle / "target" / "model.onnx.data") == data_hash  # weights untouched
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "model.onnx.data"]  # no temp left

    fresh_options = BuildOptions(
        "int4", context_length=256, tree_attention=True, attention_pad=True, feature_layers=layers
    )  # as the exporter builds the target
    upgraded, fresh = Decoder(str(path), cfg, 256), Decoder(build_decoder(weights, fresh_options), cfg, 256)
    assert upgraded.names == fresh.names
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 10)
    for start, stop, num_logits in ((0, 9, 1), (9, 10, 1)):
        a, b = upgraded.run(ids, start, stop, num_logits), fresh.run(ids, start, stop, num_logits)
        for name in fresh.names:
            assert np.array_equal(a[name], b[name]), name

    add_feature_output(path, (0,))  # upgrading again replaces the output
    assert feature_layers_of(path) == (0,)
    assert [o.name for o in onnx.load(str(path), load_external_data=False).graph.output].count("features") == 1
    with pytest.raises(EdgeSpecError, match="out of range"):
        add_feature_output(path, (2,))


CONFIG = tiny_head_config()


# -- (b) the head's graphs -----------------------------------------------------------------------


def dequantized_head(head: Eagle3Head, quant: str) -> Eagle3Head:
    copy = Eagle3Head(head.config).eval()
    copy.load_state_dict(head.state_dict())
    with torch.no_grad():
        for param in copy.parameters():
            if param.ndim == 2:
                param.copy_(torch.from_numpy(dequantized(param.numpy(), quant)))
    return copy


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_head_graph_matches_the_torch_head(quant):
    head = random_head()
    cfg = head.config
    options = BuildOptions(quant, accuracy_level=0, context_length=CAPACITY)
    steps = 6
    rng = np.random.default_rng(4)
    embeds = rng.standard_normal((1, steps + 1, cfg.hidden_size)).astype(np.float32)
    features = rng.standard_normal((1, steps + 1, 3 * cfg.hidden_size)).astype(np.float32)
    reference = dequantized_head(head, quant)
    with torch.no_grad():
        fused = reference.fuse(torch.from_numpy(features))
        ref_logits, ref_hidden = reference(torch.from_numpy(embeds), fused)
    tol = 2e-5 if quant == "fp32" else 1e-4

    fc = session(build_eagle_fc(eagle_head_weights(head).fc, options))
    hidden = fc.run(["hidden"], {"features": features})[0]
    np.testing.assert_allclose(hidden, fused.numpy(), rtol=0, atol=tol * np.abs(fused.numpy()).max())

    graph = session(build_eagle_head(eagle_head_weights(head), options, logits=True))
    assert [i.name for i in graph.get_inputs()] == [
        "inputs_embeds",
        "hidden",
        "seqlens_k",
        "total_sequence_length",
        "num_logits",
        "past_key_values.0.key",
        "past_key_values.0.value",
    ]
    assert [o.name for o in graph.get_outputs()] == ["logits", "hidden_out", "present.0.key", "present.0.value"]
    cache = {
        f"past_key_values.0.{kind}": np.zeros((1, cfg.num_key_value_heads, CAPACITY, cfg.head_dim), np.float32)
        for kind in ("key", "value")
    }

    def run(start: int, stop: int, num_logits: int) -> tuple[np.ndarray, np.ndarray]:
        logits, hidden_out, key, value = graph.run(
            None,
            {
                "inputs_embeds": embeds[:, start:stop],
                "hidden": hidden[:, start:stop],
                "seqlens_k": np.array([stop - 1], np.int32),
                "total_sequence_length": np.array(stop, np.int32),
                "num_logits": np.array([num_logits], np.int64),
                **cache,
            },
        )
        cache.update({"past_key_values.0.key": key, "past_key_values.0.value": value})
        return logits[0], hidden_out[0]

    logits, hidden_out = run(0, steps, steps)  # a multi-token prefix, every position's logits
    assert logits.shape == (steps, cfg.draft_vocab_size) and hidden_out.shape == (steps, cfg.hidden_size)
    scale = np.abs(ref_logits.numpy()).max()
    np.testing.assert_allclose(logits, ref_logits[0, :steps].numpy(), rtol=0, atol=tol * scale)
    np.testing.assert_allclose(
        hidden_out, ref_hidden[0, :steps].numpy(), rtol=0, atol=tol * np.abs(ref_hidden.numpy()).max()
    )
    logits, hidden_out = run(steps, steps + 1, 1)  # one more token through the KV cache
    np.testing.assert_allclose(logits, ref_logits[0, steps:].numpy(), rtol=0, atol=tol * scale)
    np.testing.assert_allclose(
        hidden_out, ref_hidden[0, steps:].numpy(), rtol=0, atol=tol * np.abs(ref_hidden.numpy()).max()
    )


def test_draft_to_target_uses_d2t():
    head = random_head()
    draft_ids = torch.arange(CONFIG.draft_vocab_size)
    target_ids = head.draft_to_target(draft_ids)
    assert head.t2d[target_ids].all() and int(head.t2d.sum()) == CONFIG.draft_vocab_size
    assert np.array_equal(head.draft_to_target(draft_ids.numpy()), target_ids.numpy())


# -- (c, d) SpecForge checkpoints ----------------------------------------------------------------


EXPECTED_TENSORS = {
    "fc.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def test_specforge_round_trip(tmp_path):
    from safetensors import safe_open

    head = random_head(seed=1)
    save_specforge(tmp_path, CONFIG, head)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 96
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    with safe_open(tmp_path / "model.safetensors", "pt") as fh:
        assert set(fh.keys()) == EXPECTED_TENSORS  # SpecForge's names, no embedding

    target = tiny_models.loaded("t", tiny_models.make_qwen2(seed=0, layers=4), tiny_models.make_tokenizer())
    config, loaded = load_specforge(tmp_path, target.weights.config)
    assert config == CONFIG
    rng = np.random.default_rng(5)
    embeds, hidden = (torch.from_numpy(rng.standard_normal((1, 5, 64)).astype(np.float32)) for _ in range(2))
    with torch.no_grad():
        for a, b in zip(head(embeds, hidden), loaded(embeds, hidden)):
            assert torch.equal(a, b)
    assert torch.equal(head.d2t, loaded.d2t) and torch.equal(head.t2d, loaded.t2d)
    options = BuildOptions("int4", context_length=CAPACITY)
    assert (
        build_eagle_head(eagle_head_weights(loaded), options).SerializeToString()
        == build_eagle_head(eagle_head_weights(head), options).SerializeToString()
    )


def rewrite_checkpoint(directory, edit) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(directory / "model.safetensors")
    edit(state)
    save_file(state, directory / "model.safetensors")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.pop("midlayer.self_attn.k_proj.weight"), "lacks tensor 'midlayer.self_attn.k_proj.weight'"),
        (lambda s: s.pop("d2t"), "lacks tensor 'd2t'"),
        (
            lambda s: s.__setitem__("lm_head.weight", torch.zeros(95, 64)),
            r"tensor 'lm_head.weight' has shape \(95, 64\), expected \(96, 64\)",
        ),
        (
            lambda s: s.__setitem__("midlayer.extra.weight", torch.zeros(3)),
            "does not use: \\['midlayer.extra.weight'\\]",
        ),
    ],
)
def test_broken_checkpoints_are_refused_by_name(tmp_path, edit, message):
    save_specforge(tmp_path, CONFIG, random_head())
    rewrite_checkpoint(tmp_path, edit)
    with pytest.raises(EdgeSpecError, match=message):
        load_specforge(tmp_path)


def test_stored_embedding_is_ignored(tmp_path):
    head = random_head()
    save_specforge(tmp_path, CONFIG, head)
    rewrite_checkpoint(tmp_path, lambda s: s.__setitem__("embed_tokens.weight", torch.ones(384, 64)))
    _, loaded = load_specforge(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))


def test_heads_for_another_target_and_missing_files_are_refused(tmp_path):
    save_specforge(tmp_path, CONFIG, random_head())
    weights = tiny_models.loaded(
        "t", tiny_models.make_qwen2(seed=0, hidden=96, layers=4), tiny_models.make_tokenizer()
    ).weights
    with pytest.raises(EdgeSpecError, match="hidden size 64 does not match the target's 96"):
        load_specforge(tmp_path, weights.config)
    shallow = tiny_models.loaded("t", tiny_models.make_qwen2(seed=0, layers=2), tiny_models.make_tokenizer())
    with pytest.raises(EdgeSpecError, match=r"feature layers \[2, 3\] are out of range"):
        load_specforge(tmp_path, shallow.weights.config)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(EdgeSpecError, match="has no weights"):
        load_specforge(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(EdgeSpecError, match="has no config.json"):
        load_specforge(tmp_path)
    with pytest.raises(EdgeSpecError, match="not found"):
        load_specforge(tmp_path / "nope")


def test_hub_ids_fail_with_one_line_offline(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(EdgeSpecError, match="cannot download EAGLE-3 head 'acme/eagle3-head'") as info:
        load_specforge("acme/eagle3-head")
    assert "\n" not in str(info.value)


def test_config_reads_feature_layers_in_each_convention():
    raw = CONFIG.to_hf_config()
    assert Eagle3Config.from_hf_config(raw) == CONFIG
    del raw["eagle_config"], raw["eagle_aux_hidden_state_layer_ids"]
    assert Eagle3Config.from_hf_config(raw, num_target_layers=28).feature_layers == (1, 13, 24)
    raw["eagle_aux_hidden_state_layer_ids"] = [2, 14, 25]  # vLLM: inputs of those layers
    assert Eagle3Config.from_hf_config(raw).feature_layers == (1, 13, 24)
    with pytest.raises(EdgeSpecError, match="not supported"):
        Eagle3Config.from_hf_config({**raw, "architectures": ["LlamaForCausalLM"]})


# -- bundles -------------------------------------------------------------------------------------


def test_attach_eagle_head_to_a_bundle(tmp_path, tiny_pair, monkeypatch):
    from edge_spec.export.eagle import model as eagle
    from edge_spec.export.eagle.attach import attach_eagle_head
    from edge_spec.manifest import read_manifest, verify_files
    from tests.conftest import export_tiny

    bundle = export_tiny(tmp_path / "bundle", tiny_pair, quant="int4")
    config = dataclasses.replace(CONFIG, feature_layers=(0, 1, 1))  # the tiny target has 2 layers
    head = random_head(config=config)
    before = {p.relative_to(bundle): p.read_bytes() for p in bundle.rglob("*") if p.is_file()}

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(eagle, "add_feature_output", broken)
    with pytest.raises(OSError):
        attach_eagle_head(bundle, config, head)
    assert {p.relative_to(bundle): p.read_bytes() for p in bundle.rglob("*") if p.is_file()} == before
    monkeypatch.undo()

    manifest = attach_eagle_head(bundle, config, head, source="memory:head")
    assert manifest == read_manifest(bundle)
    verify_files(bundle, manifest, full_hash=True)  # the rewritten target graph's record is current
    record = manifest["eagle"]
    assert record["feature_layers"] == [0, 1, 1] and manifest["target"]["feature_layers"] == [0, 1, 1]
    assert sorted(p.name for p in (bundle / "eagle").iterdir()) == [
        "d2t.npy",
        "fc.onnx",
        "fc.onnx.data",
        "head_full.onnx",
        "head_full.onnx.data",
        "layer.onnx",
        "layer.onnx.data",
        "t2d.npy",
        "vocab_full.npy",
    ]
    assert set(record["heads"]) == {"full"} and record["default_head"] == "full"
    assert not (bundle / "eagle.partial").exists() and not (bundle / "eagle.old").exists()
    assert np.array_equal(np.load(bundle / record["d2t"]), head.d2t.numpy())
    assert feature_layers_of(bundle / "target" / "model.onnx") == (0, 1, 1)
    head_session = session(str(bundle / record["onnx"]))
    assert [o.name for o in head_session.get_outputs()][:2] == ["hidden_states", "hidden_out"]
    lm_head = session(str(bundle / record["heads"]["full"]["onnx"]))
    assert lm_head.get_outputs()[0].shape[-1] == config.draft_vocab_size

    attach_eagle_head(bundle, config, random_head(seed=2, config=config))  # replacing a head works too
    verify_files(bundle, read_manifest(bundle), full_hash=True)

    with pytest.raises(EdgeSpecError, match="hidden size"):
        attach_eagle_head(bundle, dataclasses.replace(config, hidden_size=32), head)
