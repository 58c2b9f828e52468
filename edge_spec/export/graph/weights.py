"""Architecture-neutral decoder weights: the hand-off between loaders and the graph builder.

Loaders (Hugging Face directory, hub id, GGUF file) all end in a
:class:`DecoderWeights`, so the ONNX builder needs to know one layout only: a
pre-norm decoder with RMSNorm, rotary attention with grouped KV heads and a
gated MLP.  What sets the families apart (rope scaling, q/k norms, Gemma's
extra norms and scaled embeddings, soft-capping, sliding windows, GeGLU) is a
named field of :class:`DecoderConfig` with a neutral default, set here from the
checkpoint's config; the builder reads the fields, never the family's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from edge_spec.errors import EdgeSpecError
from edge_spec.export.graph.rope import check_rope_scaling, rope_type

#: Architectures this module maps; the family-specific reading is in :func:`_family_fields`.
SUPPORTED_ARCHITECTURES = (
    "Qwen2ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
MLP_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class DeferredMatrix:
    """A float32 weight matrix read from its checkpoint each time an array is asked of it, never kept.

    Why: a loader that returned every matrix as an array would hold the whole float32 model (four bytes
    a weight: 6 GB for a 1.5B model) while the graph needs one matrix at a time.  A deferred matrix has
    the shape at once and the values on ``np.asarray``, so the builder reads a matrix, quantizes it,
    writes it and drops it.  ``read_rows(start, stop)`` (where the source can) reads a band of rows
    alone: an embedding-sized matrix is then quantized band by band (:func:`row_bands`)."""

    ndim = 2
    dtype = np.dtype(np.float32)

    def __init__(
        self,
        shape: tuple[int, int],
        read: Callable[[], np.ndarray],
        read_rows: Callable[[int, int], np.ndarray] | None = None,
        read_index: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.shape = (int(shape[0]), int(shape[1]))
        self._read = read
        self._read_rows = read_rows
        self._read_index = read_index

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def reads_rows(self) -> bool:
        """Whether a band of rows is read alone (else every band reads the whole matrix)."""
        return self._read_rows is not None

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        values = np.asarray(self._read(), np.float32)
        if values.shape != self.shape:
            raise ValueError(f"a deferred weight read {values.shape}, expected {self.shape}")
        return values if dtype is None else values.astype(dtype, copy=False)

    def __getitem__(self, index) -> np.ndarray:
        return np.asarray(self)[index]

    def astype(self, dtype, copy: bool = True) -> np.ndarray:
        return np.asarray(self).astype(dtype, copy=False)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` as float32, read alone where the source can."""
        if self._read_rows is None:
            return np.asarray(self)[start:stop]
        return np.asarray(self._read_rows(start, stop), np.float32)

    def take_rows(self, index: np.ndarray) -> np.ndarray:
        """``self[index]`` for sorted row indices, reading those rows alone where the source can (a check
        of a few thousand rows of an embedding-sized matrix reads those rows)."""
        index = np.asarray(index, np.int64)
        if self._read_index is not None:
            return np.asarray(self._read_index(index), np.float32)
        if self._read_rows is None or len(index) == 0:
            return np.asarray(self)[index]
        breaks = np.flatnonzero(np.diff(index) != 1) + 1
        runs = np.split(index, breaks)
        return np.concatenate([self.rows(int(run[0]), int(run[-1]) + 1) for run in runs])

    def row_slice(self, start: int, stop: int) -> "DeferredMatrix":
        """Rows ``[start, stop)`` as a deferred matrix of their own (a part of a fused projection)."""
        read_rows = self.rows
        return DeferredMatrix(
            (stop - start, self.shape[1]),
            lambda: read_rows(start, stop),
            lambda a, b: read_rows(start + a, start + b),
        )


Matrix = np.ndarray | DeferredMatrix
ROW_BAND_BYTES = 64 << 20  # float32 rows handled at a time by the band-wise passes over a large matrix


def row_bands(weight: Matrix, band_bytes: int = ROW_BAND_BYTES) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, float32 rows)`` over ``weight`` a band of about ``band_bytes`` at a time (a multiple
    of 16 rows), so that a pass over an embedding-sized matrix holds one band of it, and its
    temporaries, instead of several copies of the whole (a deferred matrix reads one band at a time)."""
    for start, stop in band_ranges(weight.shape, band_bytes):
        yield start, read_band(weight, start, stop)


def band_ranges(shape: tuple[int, int], band_bytes: int = ROW_BAND_BYTES) -> list[tuple[int, int]]:
    """The ``(start, stop)`` rows of :func:`row_bands`' bands."""
    n, k = shape
    step = max(16, band_bytes // max(4 * k, 1) // 16 * 16)
    return [(start, min(start + step, n)) for start in range(0, n, step)]


def read_band(weight: Matrix, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of ``weight`` as float32 (a deferred matrix reads those rows alone)."""
    if isinstance(weight, DeferredMatrix):
        return weight.rows(start, stop)
    return np.asarray(weight[start:stop], np.float32)


def stacked(parts: list[Matrix]) -> Matrix:
    """The row-wise concatenation of ``parts`` (a fused Q/K/V or gate/up projection); deferred where a
    part is, so that its bands are read from the parts a band at a time, never the whole."""
    if not all(isinstance(part, np.ndarray) or part.reads_rows for part in parts) or all(
        isinstance(part, np.ndarray) for part in parts
    ):
        return np.concatenate([np.asarray(part) for part in parts], axis=0)
    widths = {part.shape[1] for part in parts}
    if len(widths) != 1:
        raise ValueError(f"parts of widths {sorted(widths)} cannot be stacked")
    ends = np.cumsum([part.shape[0] for part in parts]).tolist()

    def read_rows(start: int, stop: int) -> np.ndarray:
        pieces = []
        for part, end in zip(parts, ends):
            first = end - part.shape[0]
            a, b = max(start, first), min(stop, end)
            if a < b:
                pieces.append(read_band(part, a - first, b - first))
        return np.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]

    return DeferredMatrix((ends[-1], widths.pop()), lambda: read_rows(0, ends[-1]), read_rows)


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
    # family options: each defaults to the plain Llama/Qwen2 behaviour
    rope_scaling: dict | None = None  # transformers' rope_scaling dict (see rope.py)
    original_max_position_embeddings: int | None = None  # Phi-3: pretrained context apart from rope_scaling
    partial_rotary_factor: float = 1.0  # share of head_dim that is rotated (Phi-4-mini: 0.75)
    rope_local_theta: float | None = None  # rope base of sliding-window layers (Gemma 3)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm gain is (offset + w) (Gemma: 1)
    sandwich_norms: bool = False  # RMSNorm on attention and MLP outputs too (Gemma 2/3)
    embedding_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(hidden))
    mlp_activation: str = "silu"  # gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    attn_scale: float | None = None  # attention score scale; None: 1/sqrt(head_dim)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    sliding_window: int | None = None  # keys a sliding-window layer sees (the query's included)
    sliding_layers: list[int] = field(default_factory=list)  # layers that use the window

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass
class LayerWeights:
    input_norm: np.ndarray
    q: Matrix  # [heads*head_dim, hidden]
    k: Matrix  # [kv_heads*head_dim, hidden]
    v: Matrix
    o: Matrix  # [hidden, heads*head_dim]
    post_norm: np.ndarray  # the norm before the MLP (Gemma: pre_feedforward_layernorm)
    gate: Matrix  # [inter, hidden]
    up: Matrix
    down: Matrix  # [hidden, inter]
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # [head_dim], with qk_norm
    k_norm: np.ndarray | None = None
    attn_out_norm: np.ndarray | None = None  # [hidden], with sandwich_norms (Gemma post_attention_layernorm)
    mlp_out_norm: np.ndarray | None = None  # [hidden], with sandwich_norms (post_feedforward_layernorm)


@dataclass
class DecoderWeights:
    config: DecoderConfig
    embed: Matrix  # [vocab, hidden]
    layers: list[LayerWeights] = field(default_factory=list)
    final_norm: np.ndarray | None = None
    lm_head: Matrix | None = None  # [vocab, hidden]; same object as embed when tied
    #: GGUF blocks carried into the graph unchanged, by weight name ("layers.3.q", "lm_head"; see gguf/blocks.py):
    #: a dict, or a mapping that reads them from the file when asked (gguf/carry.py)
    carried: dict = field(default_factory=dict)

    def num_parameters(self) -> int:
        """Parameters read per token (embedding rows are a lookup, so they are not counted
        unless the LM head is tied to them, in which case the head counts once)."""
        total = self.lm_head.size + self.final_norm.size
        for layer in self.layers:
            total += sum(a.size for a in layer.__dict__.values() if a is not None)
        return int(total)


def architecture_of(hf_config) -> str:
    return (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]


def check_architecture(arch: str) -> None:
    """Refuse, in one line, a family the builder has no options for."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise EdgeSpecError(
            f"unsupported architecture {arch!r}; edge-spec exports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _sliding_layers(hf_config, num_layers: int) -> tuple[int | None, list[int]]:
    """(window, layers using it): from ``layer_types`` where the config has them (Qwen2/3, Gemma), else
    every layer when a window is set (Mistral, Phi-3 apply theirs to all layers)."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        layers = [i for i, kind in enumerate(types[:num_layers]) if kind == "sliding_attention"]
    else:
        layers = list(range(num_layers)) if window else []
    if not window or not layers:
        return None, []
    return int(window), layers


def _family_fields(arch: str, c) -> dict:
    """The :class:`DecoderConfig` options ``arch`` sets from its transformers config ``c``."""
    fields: dict = {}
    scaling = getattr(c, "rope_scaling", None)
    if scaling and rope_type(scaling) != "default":
        check_rope_scaling(scaling)
        fields["rope_scaling"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(scaling).items()}
    if getattr(c, "original_max_position_embeddings", None) and arch == "Phi3ForCausalLM":
        fields["original_max_position_embeddings"] = int(c.original_max_position_embeddings)
    if getattr(c, "partial_rotary_factor", 1.0) not in (None, 1.0):
        fields["partial_rotary_factor"] = float(c.partial_rotary_factor)
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu")
    if act not in MLP_ACTIVATIONS:
        raise EdgeSpecError(f"MLP activation {act!r} is not supported; edge-spec exports {', '.join(MLP_ACTIVATIONS)}")
    fields["mlp_activation"] = MLP_ACTIVATIONS[act]
    if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        fields["qk_norm"] = True
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        fields.update(
            norm_offset=1.0,
            sandwich_norms=True,
            embedding_scale=float(np.float32(c.hidden_size**0.5)),
            attn_scale=float(c.query_pre_attn_scalar) ** -0.5,
        )
        fields["attn_logit_softcap"] = getattr(c, "attn_logit_softcapping", None)
        fields["final_logit_softcap"] = getattr(c, "final_logit_softcapping", None)
    if arch == "Gemma3ForCausalLM":
        fields["rope_local_theta"] = float(c.rope_local_base_freq)
    fields["sliding_window"], fields["sliding_layers"] = _sliding_layers(c, c.num_hidden_layers)
    return fields


def config_from_hf(hf_config) -> DecoderConfig:
    arch = architecture_of(hf_config)
    check_architecture(arch)
    heads = hf_config.num_attention_heads
    cfg = DecoderConfig(
        architecture=arch,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        rope_theta=float(getattr(hf_config, "rope_theta", 10000.0)),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        **_family_fields(arch, hf_config),
    )
    if cfg.rotary_dim != cfg.head_dim and cfg.rotary_dim % 16:
        raise EdgeSpecError(
            f"{arch}: partial rotary dimension {cfg.rotary_dim} is not supported (ONNX Runtime's "
            "GroupQueryAttention needs a multiple of 16)"
        )
    return cfg


def _split_rows(fused: Matrix, sizes: list[int], name: str) -> list[Matrix]:
    """Cut a fused projection (Phi-3's qkv_proj, gate_up_proj) into its parts, rows in order."""
    if fused.shape[0] != sum(sizes):
        raise EdgeSpecError(f"weight {name!r} has {fused.shape[0]} rows, expected {sum(sizes)}")
    if isinstance(fused, DeferredMatrix):
        ends = np.cumsum(sizes).tolist()
        return [fused.row_slice(end - size, end) for size, end in zip(sizes, ends)]
    return np.split(fused, np.cumsum(sizes)[:-1], axis=0)


def weights_from_state_dict(hf_config, state_dict) -> DecoderWeights:
    """Map a transformers state dict (``model.layers.N.self_attn.q_proj.weight`` ...) to DecoderWeights.
    ``state_dict``: any mapping of names to arrays, or to :class:`DeferredMatrix` (a source read as the
    graph is built: see ``sources.py``)."""
    cfg = config_from_hf(hf_config)
    sd = state_dict

    def get(name: str) -> np.ndarray:
        if name not in sd:
            raise EdgeSpecError(f"weight {name!r} missing from the checkpoint")
        return sd[name]

    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if p + "self_attn.qkv_proj.weight" in sd:
            q, k, v = _split_rows(sd[p + "self_attn.qkv_proj.weight"], [q_rows, kv_rows, kv_rows], p + "qkv_proj")
        else:
            q, k, v = (get(p + f"self_attn.{x}_proj.weight") for x in "qkv")
        if p + "mlp.gate_up_proj.weight" in sd:
            gate, up = _split_rows(sd[p + "mlp.gate_up_proj.weight"], [cfg.intermediate_size] * 2, p + "gate_up_proj")
        else:
            gate, up = get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")
        sandwich = cfg.sandwich_norms
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                q=q,
                k=k,
                v=v,
                o=get(p + "self_attn.o_proj.weight"),
                post_norm=get(
                    p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")
                ),
                gate=gate,
                up=up,
                down=get(p + "mlp.down_proj.weight"),
                q_bias=sd.get(p + "self_attn.q_proj.bias"),
                k_bias=sd.get(p + "self_attn.k_proj.bias"),
                v_bias=sd.get(p + "self_attn.v_proj.bias"),
                q_norm=get(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
                k_norm=get(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
                attn_out_norm=get(p + "post_attention_layernorm.weight") if sandwich else None,
                mlp_out_norm=get(p + "post_feedforward_layernorm.weight") if sandwich else None,
            )
        )
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in sd else sd["lm_head.weight"]
    return DecoderWeights(cfg, embed, layers, get("model.norm.weight"), lm_head)
