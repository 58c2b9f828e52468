"""The EAGLE-3 head ``edge-spec train-head`` writes to ``WORK/specforge/`` has the layout vLLM and SGLang
load (docs/scale-out.md).

Both engines build their draft model from ``config.json`` alone, then copy the checkpoint's tensors into it
by name: SGLang drops a tensor whose name it does not map without a word, and both read the target layers
the head fuses from a config field of their own.  A head in the wrong layout would load and draft from the
wrong features, which only shows as low acceptance.  The expectations below are the loaders' own, as data,
read from their sources:

* vLLM - ``vllm/model_executor/models/registry.py`` (``_SPECULATIVE_DECODING_MODELS``: the architecture
  names served by ``llama_eagle3.Eagle3LlamaForCausalLM``), ``vllm/transformers_utils/configs/eagle.py``
  (method ``eagle3`` keeps an architecture that ends in ``Eagle3``), ``vllm/model_executor/models/
  llama_eagle3.py`` (the draft model's parameters and ``load_weights``' renames),
  ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` and ``vllm/v1/worker/gpu_model_runner.py``
  (``get_eagle3_aux_layers_from_config``: the top-level ``eagle_aux_hidden_state_layer_ids``, else the
  target's default), ``vllm/model_executor/models/llama.py`` (id ``j`` is captured before layer ``j``;
  the states are concatenated in layer order).
* SGLang - ``python/sglang/srt/models/llama_eagle3.py`` (``EntryClass``, parameters, ``load_weights``),
  ``python/sglang/srt/model_executor/model_runner.py`` (``eagle_config["eagle_aux_hidden_state_layer_ids"]``),
  ``python/sglang/srt/models/llama.py`` (``set_eagle3_layers_to_capture``: id ``i`` is layer ``i``'s
  output, captured before layer ``i + 1``, concatenated in layer order), ``python/sglang/srt/configs/
  model_config.py`` (``_get_and_verify_dtype`` reads the config's dtype).
* SpecForge - ``specforge/modeling/draft/llama3_eagle.py`` (``LlamaForCausalLMEagle3``),
  ``specforge/modeling/auto.py`` (the config is read with ``AutoConfig``), ``specforge/export/to_sglang.py``
  (its names are SGLang's; the keys a serving checkpoint must hold), ``configs/*-eagle3.json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests import tiny_models

ARCHITECTURE = "LlamaForCausalLMEagle3"

# vLLM: architecture names whose draft class is llama_eagle3.Eagle3LlamaForCausalLM (registry.py)
VLLM_EAGLE3_LLAMA = {
    "Eagle3LlamaForCausalLM",
    "LlamaForCausalLMEagle3",
    "Eagle3Qwen2_5vlForCausalLM",
    "Eagle3Qwen3vlForCausalLM",
}
# SGLang: llama_eagle3.py's EntryClass
SGLANG_EAGLE3_LLAMA = {"LlamaForCausalLMEagle3"}

# config.json fields and the values the loaders need from a one-layer Llama EAGLE-3 head
FIXED_FIELDS = {
    "model_type": "llama",  # vLLM: AutoConfig.for_model(**model); SGLang / SpecForge: AutoConfig -> LlamaConfig
    "num_hidden_layers": 1,  # vLLM builds this many layers; SGLang adds layers past the midlayer
    "hidden_act": "silu",  # both: LlamaMLP(hidden_act)
    "tie_word_embeddings": False,  # SGLang: True would make lm_head the (target's) embedding
    "attention_bias": False,  # vLLM: the qkv projection's bias
    "rope_scaling": None,  # both: rotary as the target's, plain
}
# fields both read without a fallback (or whose fallback is wrong for a head of its own width)
READ_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "draft_vocab_size",  # SGLang reads config.draft_vocab_size as an attribute
    "torch_dtype",  # SGLang's dtype "auto" follows it
)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Sizes:
    """What the engines size the draft model's parameters from (config.json)."""

    hidden: int
    target_hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    draft_vocab: int
    vocab: int

    @classmethod
    def of(cls, raw: dict) -> Sizes:
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        return cls(
            hidden=hidden,
            target_hidden=raw.get("target_hidden_size") or hidden,  # fc reads 3 x target_hidden_size
            intermediate=raw["intermediate_size"],
            heads=heads,
            kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            draft_vocab=raw.get("draft_vocab_size") or raw["vocab_size"],
            vocab=raw["vocab_size"],
        )


# the checkpoint's tensors (SpecForge's names, which SGLang loads as they are): shape from the config, dtype
# (None: floating, the config's torch_dtype)
TENSORS: dict[str, tuple[Callable[[Sizes], tuple[int, ...]], torch.dtype | None]] = {
    "fc.weight": (lambda s: (s.hidden, 3 * s.target_hidden), None),
    "midlayer.hidden_norm.weight": (lambda s: (s.hidden,), None),
    "midlayer.input_layernorm.weight": (lambda s: (s.hidden,), None),
    "midlayer.self_attn.q_proj.weight": (lambda s: (s.heads * s.head_dim, 2 * s.hidden), None),  # on [embeds, hidden]
    "midlayer.self_attn.k_proj.weight": (lambda s: (s.kv_heads * s.head_dim, 2 * s.hidden), None),
    "midlayer.self_attn.v_proj.weight": (lambda s: (s.kv_heads * s.head_dim, 2 * s.hidden), None),
    "midlayer.self_attn.o_proj.weight": (lambda s: (s.hidden, s.heads * s.head_dim), None),
    "midlayer.post_attention_layernorm.weight": (lambda s: (s.hidden,), None),
    "midlayer.mlp.gate_proj.weight": (lambda s: (s.intermediate, s.hidden), None),
    "midlayer.mlp.up_proj.weight": (lambda s: (s.intermediate, s.hidden), None),
    "midlayer.mlp.down_proj.weight": (lambda s: (s.hidden, s.intermediate), None),
    "norm.weight": (lambda s: (s.hidden,), None),
    "lm_head.weight": (lambda s: (s.draft_vocab, s.hidden), None),
    "d2t": (lambda s: (s.draft_vocab,), torch.int64),  # draft id d is target id d + d2t[d]
    "t2d": (lambda s: (s.vocab,), torch.bool),  # target ids the draft vocabulary covers
}


@dataclass(frozen=True)
class Loader:
    """How an engine's ``load_weights`` names a checkpoint tensor, and the parameters it fills."""

    skipped: tuple[str, ...]  # tensors it ignores (by substring, as it tests them)
    special: dict[str, str]  # tensors it takes apart from the parameters -> where they go
    renames: tuple[tuple[str, str], ...]  # substring renames, all applied, in order
    stacked: tuple[tuple[str, str], ...]  # (shard, fused parameter): the first that matches
    prefix: str  # prepended to every name that does not start with one of ``top_level``
    top_level: tuple[str, ...]
    parameters: frozenset[str]  # the draft model's parameters
    from_target: frozenset[str]  # parameters it shares with the target when the checkpoint has none

    def parameter(self, name: str) -> str | None:
        """The parameter ``name`` is loaded into (None: the tensor is ignored)."""
        if any(s in name for s in self.skipped):
            return None
        if name in self.special:
            return self.special[name]
        for old, new in self.renames:
            name = name.replace(old, new)
        for shard, fused in self.stacked:
            if shard in name:
                name = name.replace(shard, fused)
                break
        return name if name.startswith(self.top_level) else self.prefix + name


STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"))
STACKED += ((".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))


def _layer(prefix: str) -> set[str]:
    parts = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    norms = ("input_layernorm", "post_attention_layernorm", "hidden_norm")
    return {f"{prefix}.{p}.weight" for p in parts + norms}


LOADERS = {
    # Eagle3LlamaForCausalLM.load_weights (t2d skipped, d2t -> draft_id_to_target_id, "model." unless lm_head),
    # then LlamaModel.load_weights ("midlayer." -> "layers.0.", q/k/v and gate/up stacked)
    "vllm": Loader(
        skipped=("t2d",),
        special={"d2t": "draft_id_to_target_id"},
        renames=(("midlayer.", "layers.0."),),
        stacked=STACKED,
        prefix="model.",
        top_level=("lm_head",),
        parameters=frozenset(
            _layer("model.layers.0")
            | {"model.fc.weight", "model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"}
            | {"draft_id_to_target_id"}
        ),
        from_target=frozenset({"model.embed_tokens.weight"}),
    ),
    # LlamaForCausalLMEagle3.load_weights (d2t -> hot_token_id = d2t + arange, t2d skipped, names not among
    # the parameters get "model.", names that are still unknown are dropped)
    "sglang": Loader(
        skipped=("t2d",),
        special={"d2t": "hot_token_id"},
        renames=(),
        stacked=STACKED,
        prefix="model.",
        top_level=("lm_head",),
        parameters=frozenset(
            _layer("model.midlayer") | {"model.fc.weight", "model.norm.weight", "model.embed_tokens.weight"}
        )
        | {"lm_head.weight", "hot_token_id"},
        from_target=frozenset({"model.embed_tokens.weight"}),  # EAGLEWorker: set_embed(target's)
    ),
}


def target_layer_ids(raw: dict, engine: str, num_layers: int) -> list[int]:
    """The target layers (0-based, whose output is fused) an engine captures for the head, in fusion order:
    both capture in layer order.  Without ids in the config, both take the target's default ids
    ``(2, L // 2, L - 3)``, captured before those layers."""
    default = [2, num_layers // 2, num_layers - 3]
    if engine == "vllm":  # top-level ids; id j = the input of layer j
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or default
        return sorted(j - 1 for j in ids)
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")  # sglang: outputs of layers
    return sorted(ids) if ids is not None else sorted(j - 1 for j in default)


# -- a head as train-head writes it ----------------------------------------------------------------


@dataclass
class Written:
    directory: object
    head: object  # the Eagle3Head that was saved
    num_layers: int


@pytest.fixture(scope="module", params=["default", "given"])
def written(request, tmp_path_factory) -> Written:
    """A head for a tiny seeded target, made and saved as ``train-head`` makes and saves it (untrained: the
    layout is the point), with the default feature layers or ones given out of order."""
    from edge_spec.export.eagle.model import default_feature_layers, save_specforge
    from edge_spec.train import trainer

    tokenizer = tiny_models.make_tokenizer()
    model = tiny_models.make_qwen2(seed=3, layers=8)
    loaded = tiny_models.loaded("target", model, tokenizer)
    cfg = loaded.weights.config
    layers = default_feature_layers(cfg.num_layers) if request.param == "default" else (5, 0, 2)
    target = trainer.Target(cfg.to_dict(), layers, list(loaded.eos_token_ids), tmp_path_factory.mktemp("graph"))
    config = target.head_config(draft_vocab=96, intermediate=96)
    counts = np.random.default_rng(0).integers(0, 50, cfg.vocab_size)
    ids = trainer.draft_vocabulary(counts, config.draft_vocab_size, target.eos_ids)
    with torch.no_grad():
        rows = model.lm_head.weight[torch.from_numpy(ids)].numpy()
        norm = model.model.norm.weight.numpy()
    head = trainer.new_head(config, ids, rows, norm, seed=0).eval()
    directory = save_specforge(tmp_path_factory.mktemp("work") / "specforge", config, head)
    return Written(directory, head, cfg.num_layers)


def read(written: Written) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    raw = json.loads((written.directory / "config.json").read_text())
    return raw, load_file(written.directory / "model.safetensors")


# -- the tests -------------------------------------------------------------------------------------


def test_config_names_the_class_both_engines_load(written):
    raw, _ = read(written)
    architecture = raw["architectures"][0]
    assert raw["architectures"] == [ARCHITECTURE]
    # vLLM's EAGLEConfig (method eagle3) keeps a name ending in Eagle3, else prefixes it
    kept = (
        architecture
        if architecture.startswith("Eagle3") or architecture.endswith("Eagle3")
        else "Eagle3" + architecture
    )
    assert kept in VLLM_EAGLE3_LLAMA
    assert architecture in SGLANG_EAGLE3_LLAMA


def test_config_fields_are_the_ones_the_loaders_read(written):
    from transformers import AutoConfig, LlamaConfig

    raw, state = read(written)
    head = written.head.config
    assert {key: raw.get(key, "absent") for key in FIXED_FIELDS} == FIXED_FIELDS
    assert [key for key in READ_FIELDS if key not in raw] == []
    assert raw.get("target_hidden_size", raw["hidden_size"]) == raw["hidden_size"]
    assert (raw["hidden_size"], raw["vocab_size"], raw["draft_vocab_size"]) == (
        head.hidden_size,
        head.vocab_size,
        head.draft_vocab_size,
    )
    assert raw["draft_vocab_size"] < raw["vocab_size"]  # a draft vocabulary of its own: d2t maps it
    assert raw["eagle_config"]["use_aux_hidden_state"] is True  # both: fuse the target's states with fc
    floating = {tensor.dtype for tensor in state.values() if tensor.is_floating_point()}
    assert floating == {TORCH_DTYPES[raw["torch_dtype"]]}
    # what SpecForge and SGLang get from AutoConfig (vLLM from AutoConfig.for_model): every field kept
    config = AutoConfig.from_pretrained(written.directory)
    assert isinstance(config, LlamaConfig)
    assert (config.draft_vocab_size, config.head_dim, config.tie_word_embeddings) == (
        raw["draft_vocab_size"],
        raw["head_dim"],
        False,
    )
    assert config.eagle_config == raw["eagle_config"]
    assert config.eagle_aux_hidden_state_layer_ids == raw["eagle_aux_hidden_state_layer_ids"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_each_engine_captures_the_layers_the_head_was_trained_on(written, engine):
    raw, _ = read(written)
    layers = target_layer_ids(raw, engine, written.num_layers)
    assert layers == sorted(written.head.config.feature_layers)
    assert all(0 <= layer < written.num_layers for layer in layers)


@pytest.mark.parametrize("engine", sorted(LOADERS))
def test_fc_fuses_the_states_in_the_order_the_engine_concatenates_them(written, engine):
    """Both engines concatenate the captured states in layer order, whatever order the config lists."""
    raw, state = read(written)
    head = written.head
    hidden = head.config.hidden_size
    states = {
        layer: torch.randn(5, hidden, generator=torch.Generator().manual_seed(layer))
        for layer in range(written.num_layers)
    }
    ours = torch.cat([states[layer] for layer in head.config.feature_layers], dim=-1)
    theirs = torch.cat([states[layer] for layer in target_layer_ids(raw, engine, written.num_layers)], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(theirs @ state["fc.weight"].T, head.fuse(ours), rtol=1e-5, atol=1e-5)


def test_tensors_have_the_names_shapes_and_types_the_config_builds(written):
    raw, state = read(written)
    sizes = Sizes.of(raw)
    expected = {
        name: (shape(sizes), dtype or TORCH_DTYPES[raw["torch_dtype"]]) for name, (shape, dtype) in TENSORS.items()
    }
    assert {name: (tuple(t.shape), t.dtype) for name, t in state.items()} == expected


@pytest.mark.parametrize("engine", sorted(LOADERS))
def test_every_tensor_fills_a_parameter_and_every_parameter_is_filled(written, engine):
    loader = LOADERS[engine]
    _, state = read(written)
    filled = {name: loader.parameter(name) for name in state}
    stray = {name: target for name, target in filled.items() if target is not None and target not in loader.parameters}
    assert stray == {}  # SGLang would drop these silently; vLLM would fail on them
    assert set(filled.values()) - {None} == loader.parameters - loader.from_target
    assert [name for name, target in filled.items() if target is None] == ["t2d"]


def test_draft_ids_map_into_the_target_vocabulary(written):
    _, state = read(written)
    d2t, t2d = state["d2t"], state["t2d"]
    target_ids = torch.arange(len(d2t)) + d2t  # vLLM: base + draft_id_to_target_id; SGLang: hot_token_id
    assert int(target_ids.min()) >= 0 and int(target_ids.max()) < len(t2d)
    assert len(set(target_ids.tolist())) == len(d2t) and torch.equal(t2d.nonzero().flatten(), target_ids.sort().values)


def test_edge_spec_reads_the_written_head_back_as_the_same_drafter(written):
    from edge_spec.export.eagle.model import load_specforge

    config, loaded = load_specforge(written.directory)
    head = written.head
    assert config.feature_layers == tuple(sorted(head.config.feature_layers))
    generator = torch.Generator().manual_seed(0)
    states = {
        layer: torch.randn(1, 4, head.config.hidden_size, generator=generator) for layer in range(written.num_layers)
    }
    embeds = torch.randn(1, 4, head.config.hidden_size, generator=generator)
    with torch.no_grad():
        ours = head.fuse(torch.cat([states[layer] for layer in head.config.feature_layers], dim=-1))
        theirs = loaded.fuse(torch.cat([states[layer] for layer in config.feature_layers], dim=-1))
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
        for a, b in zip(loaded(embeds, theirs), head(embeds, ours)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
