"""Tiny seeded Qwen2 models and a tiny byte-level BPE tokenizer, built in-process (no download).

The drafter is the target plus seeded noise: close enough that drafts are often
accepted, different enough that rejections happen - both paths get exercised.
"""

from __future__ import annotations

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, n))\n",
    "The quick brown fox jumps over the lazy dog. Translate to French: le renard brun.",
    "Summarize: speculative decoding drafts tokens with a small model and verifies them.",
    "What is 12 * 7? Let's think step by step: 12 * 7 = 84.",
] * 4


def make_tokenizer(vocab_size: int = 320, specials=SPECIALS):
    """A byte-level BPE tokenizer (HF fast tokenizer object) with chat markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def make_qwen2(seed: int, *, vocab_size: int = 384, hidden: int = 64, layers: int = 2, init: float = 0.3):
    """A random Qwen2ForCausalLM; large ``init`` makes logits peaked so greedy ties are rare."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        initializer_range=init,
        architectures=["Qwen2ForCausalLM"],
    )
    return Qwen2ForCausalLM(config).eval()


def perturbed_copy(model, seed: int, noise: float):
    """The drafter: the target's weights plus relative Gaussian noise."""
    import copy

    import torch

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(noise * param.std() * torch.randn(param.shape, generator=gen))
    return draft


def loaded(name: str, model, tokenizer):
    """Wrap an in-memory model as the exporter's LoadedModel."""
    from edge_spec.export.graph.weights import weights_from_state_dict
    from edge_spec.export.sources.resolve import LoadedModel

    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    weights = weights_from_state_dict(model.config, state)
    eos = sorted({tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")})
    return LoadedModel(name, f"memory:{name}", weights, tokenizer, eos)


def torch_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Reference greedy decoding with the PyTorch model (full recompute, no cache tricks)."""
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(np.argmax(logits.numpy())))
    return ids[len(prompt_ids) :]


K_QUANT_BYTES = {"Q4_K": 144, "Q6_K": 210}  # one super-block of 256 weights


def random_k_quant_blocks(rng, kind: str, n: int, k: int, factor: tuple[float, float] = (1e-3, 2e-2)):
    """GGUF bytes of a ``[n, k]`` weight in ``kind`` (Q4_K or Q6_K): random codes and scales, the float16
    factors (Q4_K's d and dmin, Q6_K's d) drawn from ``factor`` (the gguf package dequantizes these formats
    but does not make them)."""
    import numpy as np

    raw = rng.integers(0, 256, size=(n, k // 256, K_QUANT_BYTES[kind]), dtype=np.uint8)
    factors = rng.uniform(*factor, size=(n, k // 256, 2)).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":
        raw[..., 0:4] = factors
    else:
        raw[..., 208:210] = factors[..., 0:2]
    return raw.reshape(n, -1)


def q6_k_blocks(weight):
    """GGUF Q6_K bytes of a float ``[n, k]`` weight (k a multiple of 256), by a plain rounding: per super-block
    one float16 factor d, per 16 weights an int8 scale, codes q with w = d * scale * (q - 32) (the layout
    ``blocks._q6_k`` reads)."""
    import numpy as np

    n, k = weight.shape
    values = np.asarray(weight, np.float32).reshape(-1, 16, 16)  # [super-block, sub-block, weight]
    amax = np.abs(values).max(axis=-1)
    d = (amax.max(axis=-1) / (31 * 127)).astype(np.float16)
    step = np.maximum(d.astype(np.float32), np.finfo(np.float16).tiny)
    scales = np.clip(np.round(amax / (31 * step[:, None])), 1, 127).astype(np.int8)
    unit = step[:, None, None] * scales[..., None].astype(np.float32)
    codes = (np.clip(np.round(values / unit), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.empty((len(codes), 2, 64), np.uint8)
    ql[..., :32] = (codes[:, :, 0] & 0x0F) | ((codes[:, :, 2] & 0x0F) << 4)
    ql[..., 32:] = (codes[:, :, 1] & 0x0F) | ((codes[:, :, 3] & 0x0F) << 4)
    qh = sum(((codes[:, :, g] >> 4) & 0x03) << (2 * g) for g in range(4)).astype(np.uint8)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), scales.view(np.uint8), d.reshape(-1, 1).view(np.uint8)]
    return np.concatenate(parts, axis=1).reshape(n, -1)


NATIVE_WIDTH = 256  # the native op takes rows of whole 256-weight super-blocks
LAYER_PARTS = ("q", "k", "v", "o", "gate", "up", "down")


def carried_pair(hidden: int = NATIVE_WIDTH):
    """The tiny pair at a width the native op takes, the target's layer matrices carried as Q4_K blocks of its
    own weights (so the drafter, a perturbed copy, agrees with it often): ``({name: loaded model}, {matrix:
    its raw blocks})``, the models named "tiny-target" and "tiny-draft"."""
    from edge_spec.export.gguf.blocks import carry_gguf
    from edge_spec.export.gguf.q4_k import quantize_q4_k

    tokenizer = make_tokenizer()
    target_model = make_qwen2(seed=0, hidden=hidden)
    target = loaded("tiny-target", target_model, tokenizer)
    draft = loaded("tiny-draft", perturbed_copy(target_model, seed=1, noise=0.15), tokenizer)
    raw = {}
    for i, layer in enumerate(target.weights.layers):
        for part in LAYER_PARTS:
            weight = getattr(layer, part)
            raw[f"layers.{i}.{part}"] = quantize_q4_k(weight)
            target.weights.carried[f"layers.{i}.{part}"] = carry_gguf(raw[f"layers.{i}.{part}"], "Q4_K", *weight.shape)
    return {"tiny-target": target, "tiny-draft": draft}, raw
