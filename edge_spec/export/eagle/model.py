"""EAGLE-3 feature-level drafter head: config, PyTorch module, SpecForge checkpoints, ONNX graphs.

EAGLE-3 drafts from the *target's* hidden states instead of running a second small model: the
target also outputs its residual stream after three layers (low / mid / high), ``fc`` fuses
their concatenation ``[.., 3H]`` down to ``[.., H]``, and one decoder layer (``midlayer``) reads
that fused state together with the embedding of the next token, then ``norm`` and an LM head
over a reduced *draft* vocabulary of K rows.  For the next draft step the head feeds itself its
own pre-norm output instead of fused target features (so only the first step needs the target).

The layout follows SpecForge's ``LlamaForCausalLMEagle3`` (``specforge/modeling/draft/
llama3_eagle.py``) exactly, so its checkpoints (and SGLang's / vLLM's, which share the names)
load unchanged:

* ``fc.weight`` [H, 3H];
* ``midlayer.hidden_norm`` (RMSNorm of the fused hidden) and ``midlayer.input_layernorm``
  (RMSNorm of the token embedding), whose outputs are concatenated ``[embeds, hidden]`` (2H);
* ``midlayer.self_attn.{q,k,v}_proj`` on that 2H input, ``o_proj`` back to H, rotary as the
  target's (non-interleaved, ``rope_theta``); the residual is the *un-normed* fused hidden;
* ``midlayer.post_attention_layernorm`` + SwiGLU ``midlayer.mlp.{gate,up,down}_proj``;
* ``norm`` then ``lm_head`` [K, H];
* buffers ``d2t`` int64 [K] (draft id ``d`` is target id ``d + d2t[d]``) and ``t2d`` bool [V]
  (target ids the draft vocabulary covers).

The token embedding is **not** part of the head: SpecForge trains with the target's embedding
frozen and its checkpoints leave ``embed_tokens`` out (its HF export may add a copy, which we
ignore), so the runtime embeds with the target's table and the head graph takes
``inputs_embeds``.

Feature layers (``eagle_config.eagle_aux_hidden_state_layer_ids`` in the config) are 0-based
indices of target layers whose *outputs* are used - the SpecForge / SGLang convention (SGLang
captures "before layer i + 1").  Default as SpecForge: ``(1, L // 2 - 1, L - 4)``.  A written
``config.json`` also carries them at the top level, ``+ 1``, as vLLM reads them, and a written checkpoint
lists them in ascending order, the order in which vLLM and SGLang concatenate the states.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from torch import nn

from edge_spec.errors import EdgeSpecError
from edge_spec.export.graph.builder import (
    FEATURES,
    BuildOptions,
    DecoderGraphBuilder,
    Graph,
    Residual,
    add_linear,
    feature_output,
    make_model,
)
from edge_spec.export.graph.weights import DecoderConfig, DecoderWeights, LayerWeights
from edge_spec.files import write_atomic

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
EMBEDDING_KEY = "embed_tokens.weight"  # present in some exports; the target's embedding is used instead


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """SpecForge's default low / mid / high feature layers ``(1, L // 2 - 1, L - 4)`` (outputs of those
    0-based layers; SGLang's and vLLM's defaults capture the same states): (1, 13, 24) for 28 layers."""
    layers = (1, num_layers // 2 - 1, num_layers - 4)
    if len(set(layers)) != 3 or min(layers) < 0 or max(layers) >= num_layers:
        raise EdgeSpecError(
            f"a {num_layers}-layer target is too shallow for the default EAGLE-3 feature layers "
            f"{layers}; give three distinct layer indices"
        )
    return layers


@dataclass(frozen=True)
class Eagle3Config:
    """What an EAGLE-3 head is shaped like; maps to / from SpecForge's ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's vocabulary (t2d's length)
    draft_vocab_size: int  # K: rows of the head's lm_head
    feature_layers: tuple[int, ...]  # target layers whose outputs ``fc`` fuses, in concatenation order
    max_position_embeddings: int = 32768

    def to_hf_config(self) -> dict:
        """``config.json`` as SpecForge writes it for ``LlamaForCausalLMEagle3`` (one ``midlayer``)."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.feature_layers),
                "use_aux_hidden_state": True,
            },
            # vLLM reads only this key, in its convention (id j: the input of layer j); without it vLLM
            # captures its own default layers, which are these only for SpecForge's default choice
            "eagle_aux_hidden_state_layer_ids": [layer + 1 for layer in self.feature_layers],
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_config(cls, config: dict, num_target_layers: int | None = None) -> Eagle3Config:
        """Read a SpecForge ``config.json``; refuse variants the ONNX head does not implement.

        Feature layers come from ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge /
        SGLang: outputs of those layers); a top-level ``eagle_aux_hidden_state_layer_ids`` is read in
        vLLM's convention (id ``j`` = input of layer ``j``, so layer ``j - 1``'s output); with neither,
        SpecForge's default for a ``num_target_layers``-layer target."""

        def need(key: str):
            if key not in config:
                raise EdgeSpecError(f"EAGLE-3 config.json has no {key!r}")
            return config[key]

        arch = (config.get("architectures") or [None])[0]
        if arch != ARCHITECTURE:
            raise EdgeSpecError(f"EAGLE-3 head architecture {arch!r} is not supported (expected {ARCHITECTURE})")
        if config.get("hidden_act", "silu") != "silu":
            raise EdgeSpecError(f"EAGLE-3 head activation {config['hidden_act']!r} is not supported (silu only)")
        scaling = config.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise EdgeSpecError(f"EAGLE-3 head rope scaling {scaling!r} is not supported yet")
        if config.get("fc_norm") or config.get("norm_output", True) is False:
            raise EdgeSpecError("EAGLE-3 heads with fc_norm or norm_output=false are not supported")
        if config.get("num_hidden_layers", 1) != 1:
            raise EdgeSpecError(
                f"EAGLE-3 head has {config['num_hidden_layers']} layers; only one (midlayer) is supported"
            )
        hidden = int(need("hidden_size"))
        target_hidden = int(config.get("target_hidden_size") or hidden)
        if target_hidden != hidden:
            raise EdgeSpecError(
                f"EAGLE-3 head hidden size {hidden} differs from its target_hidden_size "
                f"{target_hidden}; "
                "only heads as wide as the target are supported"
            )
        heads = int(need("num_attention_heads"))
        vocab = int(need("vocab_size"))
        layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if layers is None and config.get("eagle_aux_hidden_state_layer_ids"):
            layers = [int(j) - 1 for j in config["eagle_aux_hidden_state_layer_ids"]]
        if layers is None:
            if num_target_layers is None:
                raise EdgeSpecError(
                    "EAGLE-3 config.json names no feature layers "
                    "(eagle_config.eagle_aux_hidden_state_layer_ids) and no target was given"
                )
            layers = default_feature_layers(num_target_layers)
        layers = tuple(int(layer) for layer in layers)
        if len(layers) != 3:
            raise EdgeSpecError(f"EAGLE-3 head fuses {len(layers)} feature layers {list(layers)}; expected 3")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            vocab_size=vocab,
            draft_vocab_size=int(config.get("draft_vocab_size") or vocab),
            feature_layers=layers,
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
        )

    def check_target(self, target: DecoderConfig) -> None:
        """Refuse a head trained for another target: its features and vocabulary would not line up."""
        if self.hidden_size != target.hidden_size:
            raise EdgeSpecError(
                f"EAGLE-3 head hidden size {self.hidden_size} does not match the target's {target.hidden_size}"
            )
        if self.vocab_size != target.vocab_size:
            raise EdgeSpecError(
                f"EAGLE-3 head vocabulary {self.vocab_size} does not match the target's {target.vocab_size}"
            )
        bad = [layer for layer in self.feature_layers if not 0 <= layer < target.num_layers]
        if bad:
            raise EdgeSpecError(
                f"EAGLE-3 feature layers {bad} are out of range for the {target.num_layers}-layer target"
            )


# -- PyTorch module ------------------------------------------------------------------------------


class _RMSNorm(nn.Module):
    """Llama RMSNorm as SpecForge computes it (float32 statistics, weight applied last)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    """Causal GQA over the concatenated [embeds, hidden] (2H wide), rotary as the target's."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        width, hd = 2 * cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(width, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(width, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(width, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)

    def rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [B, 1, T, head_dim], computed in float64 like the ONNX graph's tables."""
        hd = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        freqs = position_ids.to(torch.float64)[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(torch.float32), emb.sin().to(torch.float32)

    def project(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [B, heads, T, head_dim], rotary applied and kv heads repeated."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = self.rotary(position_ids)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj of attention output [B, heads, T, head_dim]."""
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.cfg.num_attention_heads * self.cfg.head_dim))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, position_ids)
        return self.output(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


class _MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.hidden_norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        joined = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        hidden = hidden + self.self_attn(joined, position_ids)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """SpecForge's ``LlamaForCausalLMEagle3`` without its (frozen, shared) embedding.

    Parameter and buffer names equal SpecForge's, so ``state_dict()`` is a SpecForge checkpoint.
    ``forward`` is the teacher-forced (training) pass: causal attention over the T given positions.
    """

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        h, k, v = config.hidden_size, config.draft_vocab_size, config.vocab_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = _RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, k, bias=False)
        # identity map onto the first K target ids until a vocabulary is chosen
        self.register_buffer("d2t", torch.zeros(k, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(v) < k)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3H] (layers concatenated in ``feature_layers`` order) -> [..., H]."""
        return self.fc(features)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``embeds`` [B, T, H] (target embedding of the *next* token at each position), ``hidden``
        [B, T, H] (fused features or the head's previous ``out_hidden``) -> (draft logits [B, T, K],
        ``out_hidden`` [B, T, H] before the final norm: the next step's ``hidden``)."""
        if position_ids is None:
            position_ids = torch.arange(embeds.shape[1])[None].expand(embeds.shape[0], -1)
        out = self.midlayer(embeds, hidden, position_ids)
        return self.lm_head(self.norm(out)), out

    def draft_to_target(self, ids):
        """Draft-vocabulary ids -> target ids (``d + d2t[d]``); torch tensors or numpy arrays."""
        if isinstance(ids, torch.Tensor):
            return ids + self.d2t[ids]
        ids = np.asarray(ids)
        return ids + self.d2t.numpy()[ids]


# -- SpecForge checkpoints -----------------------------------------------------------------------


def in_layer_order(config: Eagle3Config, state: dict[str, torch.Tensor]) -> tuple[Eagle3Config, dict]:
    """The same head with its feature layers in ascending order: ``fc``'s column blocks permuted to match.

    vLLM and SGLang capture the target's states layer by layer and concatenate them in that order, whatever
    order the config lists; a head fusing another order would load and draft from mixed-up features."""
    order = sorted(range(len(config.feature_layers)), key=lambda i: config.feature_layers[i])
    if order == list(range(len(order))):
        return config, state
    h = config.hidden_size
    fc = state["fc.weight"]
    state = {**state, "fc.weight": torch.cat([fc[:, i * h : (i + 1) * h] for i in order], dim=1).contiguous()}
    layers = tuple(config.feature_layers[i] for i in order)
    return replace(config, feature_layers=layers), state


def save_specforge(directory, config: Eagle3Config, head: Eagle3Head) -> Path:
    """Write ``config.json`` + ``model.safetensors`` as SpecForge, SGLang and vLLM read them (no embedding),
    the feature layers in ascending order (:func:`in_layer_order`)."""
    from safetensors.torch import save_file

    if head.config != config:
        raise ValueError("head was built for another Eagle3Config")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous() for name, tensor in head.state_dict().items()}
    config, state = in_layer_order(config, state)
    write_atomic(directory / "model.safetensors", lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    text = json.dumps(config.to_hf_config(), indent=2) + "\n"
    write_atomic(directory / "config.json", lambda tmp: Path(tmp).write_text(text))
    return directory


def _resolve_source(source) -> Path:
    """A local directory, or a hub id downloaded with ``huggingface_hub.snapshot_download``."""
    from edge_spec.export.sources.resolve import HUB_ID

    path = Path(source).expanduser()
    if path.is_dir():
        return path
    text = str(source)
    if path.exists() or not HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise EdgeSpecError(f"EAGLE-3 head not found: {text} (not a directory or a hub id)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=["config.json", "model*.safetensors", *WEIGHT_FILES[1:]]))
    except Exception as exc:  # offline, unknown repo, gated, ...: one line for the CLI
        first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:160]
        raise EdgeSpecError(
            f"cannot download EAGLE-3 head {text!r} from the Hugging Face hub "
            f"({type(exc).__name__}: {first}); no network? pass a local directory"
        ) from exc


def _read_state(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in ``directory`` (single or sharded safetensors, or torch .bin)."""
    from safetensors.torch import load_file

    if (directory / "model.safetensors").is_file():
        return load_file(directory / "model.safetensors")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            if not (directory / shard).is_file():
                raise EdgeSpecError(f"EAGLE-3 checkpoint {directory}: shard {shard} is missing")
            state.update(load_file(directory / shard))
        return state
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise EdgeSpecError(f"EAGLE-3 checkpoint {directory} has no weights (none of {', '.join(WEIGHT_FILES)})")


def load_specforge(source, target: DecoderConfig | None = None) -> tuple[Eagle3Config, Eagle3Head]:
    """Load a SpecForge EAGLE-3 head from a directory or hub id, checked against ``target`` when given.

    Every tensor of the head must be present with its exact shape (a head silently missing a weight
    would draft garbage); ``d2t`` / ``t2d`` may be absent only when the draft vocabulary is the
    target's.  A stored ``embed_tokens.weight`` is ignored: the target's embedding is the one used.
    """
    directory = _resolve_source(source)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise EdgeSpecError(f"EAGLE-3 checkpoint {directory} has no config.json")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise EdgeSpecError(f"{config_path}: invalid JSON ({exc.msg} at line {exc.lineno})") from exc
    config = Eagle3Config.from_hf_config(raw, target.num_layers if target is not None else None)
    if target is not None:
        config.check_target(target)
    state = _read_state(directory)
    state.pop(EMBEDDING_KEY, None)
    head = Eagle3Head(config)
    expected = head.state_dict()
    if config.draft_vocab_size == config.vocab_size:
        for name in ("d2t", "t2d"):
            state.setdefault(name, expected[name])
    for name, tensor in expected.items():
        if name not in state:
            raise EdgeSpecError(f"EAGLE-3 checkpoint {directory} lacks tensor {name!r}")
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise EdgeSpecError(
                f"EAGLE-3 checkpoint {directory}: tensor {name!r} has shape "
                f"{tuple(state[name].shape)}, expected {tuple(tensor.shape)}"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise EdgeSpecError(f"EAGLE-3 checkpoint {directory} has tensors this head does not use: {extra[:4]}")
    head.load_state_dict({name: state[name].to(expected[name].dtype) for name in expected})
    return config, head.eval()


# -- ONNX ----------------------------------------------------------------------------------------


@dataclass
class EagleHeadWeights:
    """The head as numpy arrays, laid out for :func:`build_eagle_head` / :func:`build_eagle_fc`."""

    config: Eagle3Config
    fc: np.ndarray  # [H, 3H]
    hidden_norm: np.ndarray  # [H]
    layer: LayerWeights  # input_norm = input_layernorm (of the embeddings); q/k/v are [.., 2H]
    norm: np.ndarray  # [H]
    lm_head: np.ndarray  # [K, H]
    d2t: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [K]
    t2d: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # [V]

    def decoder_weights(self) -> DecoderWeights:
        """The head as a one-layer :class:`DecoderWeights`, so the decoder builder's parts apply."""
        cfg = self.config
        dcfg = DecoderConfig(
            architecture=ARCHITECTURE,
            vocab_size=cfg.draft_vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=1,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=False,
        )
        no_embedding = np.zeros((0, cfg.hidden_size), np.float32)  # the target's embedding is used
        return DecoderWeights(dcfg, no_embedding, [self.layer], self.norm, self.lm_head)


def eagle_head_weights(head: Eagle3Head) -> EagleHeadWeights:
    """Float32 numpy copies of ``head``'s weights (plus its vocabulary maps)."""

    def a(t: torch.Tensor) -> np.ndarray:
        return t.detach().to(torch.float32).numpy().copy()

    m = head.midlayer
    layer = LayerWeights(
        input_norm=a(m.input_layernorm.weight),
        q=a(m.self_attn.q_proj.weight),
        k=a(m.self_attn.k_proj.weight),
        v=a(m.self_attn.v_proj.weight),
        o=a(m.self_attn.o_proj.weight),
        post_norm=a(m.post_attention_layernorm.weight),
        gate=a(m.mlp.gate_proj.weight),
        up=a(m.mlp.up_proj.weight),
        down=a(m.mlp.down_proj.weight),
    )
    return EagleHeadWeights(
        head.config,
        a(head.fc.weight),
        a(m.hidden_norm.weight),
        layer,
        a(head.norm.weight),
        a(head.lm_head.weight),
        head.d2t.numpy().copy(),
        head.t2d.numpy().copy(),
    )


def build_eagle_head(weights: EagleHeadWeights, options: BuildOptions, *, logits: bool = False) -> onnx.ModelProto:
    """The head's decoder layer graph, from the decoder builder's parts (same fused ops, int4 like the decoder).

    inputs  ``inputs_embeds`` [1, S, H] (target embedding of the next token per position),
            ``hidden`` [1, S, H] (fused target features, or the head's own previous ``hidden_out``),
            ``seqlens_k``, ``total_sequence_length``, ``num_logits`` (and with ``tree_attention``
            ``position_ids`` / ``attention_bias``), ``past_key_values.0.key|value`` - as the decoder;
    outputs ``hidden_states`` [1, num_logits, H] (after the final norm: what an LM head reads),
            ``hidden_out`` [1, num_logits, H] (pre-norm), ``present.0.key|value`` (the shared
            past/present buffers).

    The LM head over the draft vocabulary is a graph of its own (:func:`graph.builder.build_head`,
    or a SpecVocab scorer), so one layer serves several heads, as the drafter's body does.  With
    ``logits`` the graph outputs ``logits`` [1, num_logits, K] (the draft vocabulary) in place of
    ``hidden_states``: the single-graph layout of bundles made before the heads were split off.
    """
    h = weights.config.hidden_size
    b = DecoderGraphBuilder(weights.decoder_weights(), options)
    g = b.graph
    rotary = b.rotary_tables()
    b.step_inputs(
        [
            helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, [1, "sequence", h]),
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "sequence", h]),
        ]
    )
    layer = weights.layer
    embeds = b.norm(
        Residual("inputs_embeds"), layer.input_norm, "layers.0.input_layernorm", ("layers.0/embeds_norm", "", "", "")
    )[0]
    hidden = b.norm(
        Residual("hidden"), weights.hidden_norm, "layers.0.hidden_norm", ("layers.0/hidden_norm", "", "", "")
    )[0]
    joined = g.node("Concat", [embeds, hidden], ["layers.0/joined"], axis=-1)[0]
    # the residual is the un-normed hidden; the attention output is added by the post-attention norm
    stream = Residual("hidden", b.attention(0, layer, joined, rotary))
    normed, stream = b.norm(
        stream,
        layer.post_norm,
        "layers.0.post_norm",
        ("layers.0/norm2", "layers.0/n2_mean", "layers.0/n2_inv", "layers.0/resid2"),
    )
    out = g.node("Add", [stream.total, b.mlp(0, layer, normed)], ["layers.0/out"])[0]
    last = b.last_positions(out)  # slice before the norm and LM head: only num_logits rows need them
    g.node("Identity", [last], ["hidden_out"])
    final = b.final_norm(Residual(last))
    first = b.logits_output(final) if logits else b.hidden_output(final)
    hidden_out = helper.make_tensor_value_info("hidden_out", TensorProto.FLOAT, [1, "num_logits", h])
    return b.to_model([first, hidden_out], "edge_spec_eagle3_head")


def split_lm_head(onnx_path, out_path) -> np.ndarray:
    """Turn a single-graph head (``logits`` output, bundles made before the LM heads were split off)
    into the layer graph :func:`build_eagle_head` builds now: its final-normed state becomes output
    ``hidden_states`` and the LM head goes.  Writes ``out_path`` (+ ``.data``) and returns the LM head
    rows [K, H] as the old graph stored them (dequantized), for the head graphs to be built from."""
    from edge_spec.export.graph.builder import save_model
    from edge_spec.runtime.model.embedding import TargetLMHead

    path = Path(onnx_path)
    rows = TargetLMHead.from_onnx(path).table()
    model = onnx.load(str(path))
    graph = model.graph
    if "logits" not in [o.name for o in graph.output]:
        raise EdgeSpecError(f"{path} has no logits output: it is not a single-graph EAGLE head")
    producers = {name: n for n in graph.node for name in n.output}
    head = next(n for n in graph.node if len(n.input) > 1 and n.input[1].startswith("lm_head."))
    # everything between the LM head's input and ``logits`` goes (the MatMul, a softcap, the Identity)
    drop, frontier = [], ["logits"]
    while frontier:
        node = producers.get(frontier.pop())
        if node is None or node in drop:
            continue
        drop.append(node)
        if node is not head:
            frontier.extend(node.input)
    for node in drop:
        graph.node.remove(node)
    used = {name for n in graph.node for name in n.input}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)
    graph.node.append(helper.make_node("Identity", [head.input[0]], ["hidden_states"]))
    index = [o.name for o in graph.output].index("logits")
    graph.output.remove(graph.output[index])
    hidden = helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [1, "num_logits", rows.shape[1]])
    graph.output.insert(index, hidden)
    save_model(model, out_path)
    return rows


def build_eagle_fc(weight: np.ndarray, options: BuildOptions) -> onnx.ModelProto:
    """``features`` [1, S, 3H] -> ``hidden`` [1, S, H] (the head's ``fc``), a graph of its own: the
    runtime fuses target features of accepted positions with it, while later draft steps feed
    the head its own ``hidden_out`` and skip it."""
    g = Graph()
    out = add_linear(g, FEATURES, weight, "fc", options)
    g.node("Identity", [out], ["hidden"])
    n, k = weight.shape
    graph = helper.make_graph(
        g.nodes,
        "edge_spec_eagle3_fc",
        [helper.make_tensor_value_info(FEATURES, TensorProto.FLOAT, [1, "sequence", k])],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "sequence", n])],
        g.initializers,
    )
    return make_model(graph)


def _decoder_layer_count(graph: onnx.GraphProto) -> int:
    names = {init.name for init in graph.initializer}
    layers = 0
    while any(name.startswith(f"layers.{layers}.") for name in names):
        layers += 1
    return layers


def add_feature_output(onnx_path, layers) -> None:
    """Give an already exported decoder graph the ``features`` output, in place.

    Only the graph file is rewritten (weights stay in the same external ``.data`` file, not even
    read): the output wires tensors the graph already computes, the same node
    ``BuildOptions(feature_layers=...)`` builds.  A ``features`` output already there is
    replaced.  The new file is written beside the old one and renamed over it.
    """
    path = Path(onnx_path)
    if not path.is_file():
        raise EdgeSpecError(f"ONNX model not found: {path}")
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    num_layers = _decoder_layer_count(graph)
    if num_layers == 0:
        raise EdgeSpecError(f"{path} is not an edge-spec decoder graph (no layers.N weights)")
    hidden = next((init.dims[0] for init in graph.initializer if init.name == "final_norm"), None)
    if hidden is None:
        raise EdgeSpecError(f"{path} is not an edge-spec decoder graph (no final_norm)")
    try:
        node, info = feature_output(layers, num_layers, int(hidden))
    except ValueError as exc:
        raise EdgeSpecError(f"{path}: {exc}") from exc
    producers = {name: n for n in graph.node for name in n.output}
    for name in node.input:
        producer = producers.get(name)
        if producer is None or producer.op_type != "SkipSimplifiedLayerNormalization" or producer.output[3] != name:
            raise EdgeSpecError(f"{path}: tensor {name!r} is not a fused norm's summed stream; re-export the target")
    old = [n for n in graph.node if FEATURES in n.output]
    for n in old:
        graph.node.remove(n)
    for out in [o for o in graph.output if o.name == FEATURES]:
        graph.output.remove(out)
    graph.node.append(node)
    # after the other non-cache outputs, before present.* - where the builder puts it
    position = next((i for i, o in enumerate(graph.output) if o.name.startswith("present.")), len(graph.output))
    graph.output.insert(position, info)
    write_atomic(path, lambda tmp: onnx.save_model(model, tmp))


def feature_layers_of(onnx_path) -> tuple[int, ...] | None:
    """The layers a decoder graph's ``features`` output holds (None: it has none)."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    node = next((n for n in graph.node if FEATURES in n.output), None)
    if node is None:
        return None
    num_layers = _decoder_layer_count(graph)
    layer_of = {f"layers.{i + 1}/resid1": i for i in range(num_layers - 1)} | {"final/resid": num_layers - 1}
    return tuple(layer_of[name] for name in node.input)


__all__ = [
    "Eagle3Config",
    "Eagle3Head",
    "EagleHeadWeights",
    "add_feature_output",
    "build_eagle_fc",
    "build_eagle_head",
    "default_feature_layers",
    "eagle_head_weights",
    "feature_layers_of",
    "load_specforge",
    "save_specforge",
    "split_lm_head",
]
