"""Architecture-neutral decoder weights: the hand-off between loaders and the graph builder.

Loaders (Hugging Face directory, hub id, GGUF file) all end in a
:class:`DecoderWeights`, so the ONNX builder needs to know one layout only:
a pre-norm decoder with RMSNorm, rotary attention with grouped KV heads and a
SwiGLU MLP (Llama, Qwen2, Mistral families).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge_spec.errors import EdgeSpecError

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")


@dataclass
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class LayerWeights:
    input_norm: np.ndarray
    q: np.ndarray  # [heads*head_dim, hidden]
    k: np.ndarray  # [kv_heads*head_dim, hidden]
    v: np.ndarray
    o: np.ndarray  # [hidden, heads*head_dim]
    post_norm: np.ndarray
    gate: np.ndarray  # [inter, hidden]
    up: np.ndarray
    down: np.ndarray  # [hidden, inter]
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None


@dataclass
class DecoderWeights:
    config: DecoderConfig
    embed: np.ndarray  # [vocab, hidden]
    layers: list[LayerWeights] = field(default_factory=list)
    final_norm: np.ndarray | None = None
    lm_head: np.ndarray | None = None  # [vocab, hidden]; same array as embed when tied

    def num_parameters(self) -> int:
        """Parameters read per token (embedding rows are a lookup, so they are not counted
        unless the LM head is tied to them, in which case the head counts once)."""
        total = self.lm_head.size + self.final_norm.size
        for layer in self.layers:
            total += sum(a.size for a in layer.__dict__.values() if a is not None)
        return int(total)


def weights_from_state_dict(hf_config, state_dict: dict[str, np.ndarray]) -> DecoderWeights:
    """Map a transformers state dict (``model.layers.N.self_attn.q_proj.weight`` ...) to DecoderWeights."""
    arch = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise EdgeSpecError(
            f"unsupported architecture {arch!r}; edge-spec exports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    rope_scaling = getattr(hf_config, "rope_scaling", None)
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
        raise EdgeSpecError(f"rope scaling {rope_scaling!r} is not supported yet")
    cfg = DecoderConfig(
        architecture=arch,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rope_theta=float(getattr(hf_config, "rope_theta", 10000.0)),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )
    sd = state_dict

    def get(name: str) -> np.ndarray:
        if name not in sd:
            raise EdgeSpecError(f"weight {name!r} missing from the checkpoint")
        return sd[name]

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                q=get(p + "self_attn.q_proj.weight"),
                k=get(p + "self_attn.k_proj.weight"),
                v=get(p + "self_attn.v_proj.weight"),
                o=get(p + "self_attn.o_proj.weight"),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate=get(p + "mlp.gate_proj.weight"),
                up=get(p + "mlp.up_proj.weight"),
                down=get(p + "mlp.down_proj.weight"),
                q_bias=sd.get(p + "self_attn.q_proj.bias"),
                k_bias=sd.get(p + "self_attn.k_proj.bias"),
                v_bias=sd.get(p + "self_attn.v_proj.bias"),
            )
        )
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in sd else sd["lm_head.weight"]
    return DecoderWeights(cfg, embed, layers, get("model.norm.weight"), lm_head)
