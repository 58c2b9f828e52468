"""How close an exported GGUF model stays to transformers' fp32 forward of the same GGUF weights: the old
path (dequantize, re-quantize to int4 blocks of 32) against carrying the GGUF blocks into MatMulNBits, exactly
and in the faster default layout (and the small one, its 8-bit blocks rounded to 4 bits).

For each GGUF file: transformers loads it (dequantizing every tensor to fp32) and is the reference; the
same weights are exported as ONNX decoders (re-quantized / carried, at accuracy level 4 as shipped and at
level 0 to show the weights alone) and compared on

* a fixed text, teacher-forced: mean |log p_ours(token) - log p_ref(token)| over its tokens, the mean
  negative log-likelihood of both, and top-1 agreement of the next-token prediction;
* greedy generation from chat prompts: tokens equal to transformers' own greedy (HF ``generate``) until
  the first difference, and the prompts whose answers are identical;
* speed: greedy tokens/s of transformers (fp32, torch threads) and of our decoder (ORT threads).

    python benchmarks/studies/gguf_fidelity.py models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf [--tokens 48] [--threads 2]
                                               [--no-level0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TEXT = (
    "The printing press, developed by Johannes Gutenberg around 1440, changed how knowledge spread across "
    "Europe. Before it, books were copied by hand, which made them rare and expensive. Within a few decades, "
    "presses were running in more than two hundred cities, and millions of volumes had been printed. Scholars "
    "could compare identical copies of a text, errors were corrected in later editions, and new ideas moved "
    "faster than any authority could control them.\n\ndef fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n"
)
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
]
#: (GGUF blocks, MatMulNBits accuracy level): "carry" is the default layout (16-blocks merged, the affine
#: formats' correction folded into the matmul: gguf_blocks.fast_layout), "carry-exact" GGUF's blocks as they are
#: "carry-small" the small layout (8-bit blocks rounded to 4 bits: gguf_blocks.narrow_to_4bit)
VARIANTS = [("requantize", 4), ("carry-exact", 4), ("carry", 4), ("carry-small", 4), ("carry-exact", 0)]


def load_reference(gguf: Path):
    """transformers' fp32 model and tokenizer of ``gguf``, plus our weights (GGUF blocks attached)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edge_spec.export.gguf.carry import attach_gguf_blocks
    from edge_spec.export.graph.weights import weights_from_state_dict

    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs).eval()
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    weights = weights_from_state_dict(model.config, state)
    report = attach_gguf_blocks(gguf, weights)
    return model, tokenizer, weights, report


def chat_ids(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    if tokenizer.chat_template:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return tokenizer.encode(prompt)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def teacher_forced(logits: np.ndarray, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(log p of each next token, argmax) for positions 0..n-2."""
    lp = log_softmax(logits[:-1])
    return lp[np.arange(len(ids) - 1), ids[1:]], lp.argmax(-1)


def reference_runs(model, tokenizer, text_ids: list[int], tokens: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    with torch.no_grad():
        logits = model(torch.tensor([text_ids])).logits[0].numpy()
        greedy, seconds, new = [], 0.0, 0
        for prompt in PROMPTS:
            ids = chat_ids(tokenizer, prompt)
            start = time.perf_counter()
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=tokens,
                do_sample=False,
                top_p=None,
                top_k=None,
                temperature=None,
                eos_token_id=None,
                pad_token_id=0,
            )
            seconds += time.perf_counter() - start
            greedy.append([int(t) for t in out[0, len(ids) :]])
            new += len(greedy[-1])
    return {"logits": logits, "greedy": greedy, "tps": new / seconds}


def onnx_runs(
    path: Path, tokenizer, text_ids: list[int], tokens: int, threads: int, prompt_graph: Path | None = None
) -> dict:
    """The graph's teacher-forced logits over ``text_ids`` and its greedy answers to :data:`PROMPTS`.  With a
    ``prompt_graph`` (``export --prompt-reader``) the text and the prompts are read through it, as the runtime
    reads prompts, and the answers decoded by ``path``."""
    from edge_spec.runtime.model.decoder import Decoder

    capacity = max(len(text_ids), max(len(chat_ids(tokenizer, p)) for p in PROMPTS) + tokens) + 8
    decoder = Decoder(path, capacity=capacity, threads=threads, prompt_graph=prompt_graph)
    if prompt_graph is None:
        logits = decoder.forward(text_ids, len(text_ids))["logits"]
    else:
        logits = decoder.prefill(text_ids, len(text_ids))["logits"]
    greedy, seconds, new = [], 0.0, 0
    for prompt in PROMPTS:
        decoder.rewind(0)
        ids = chat_ids(tokenizer, prompt)
        row = decoder.prefill(ids)["logits"][-1]
        out = []
        start = time.perf_counter()
        for _ in range(tokens):
            out.append(int(np.argmax(row)))
            row = decoder.forward([out[-1]])["logits"][-1]
        seconds += time.perf_counter() - start
        greedy.append(out)
        new += len(out)
    return {"logits": logits, "greedy": greedy, "tps": new / seconds}


def compare(ref: dict, ours: dict, text_ids: list[int]) -> dict:
    ref_lp, ref_top = teacher_forced(ref["logits"], text_ids)
    our_lp, our_top = teacher_forced(ours["logits"], text_ids)
    prefix = []
    for a, b in zip(ref["greedy"], ours["greedy"]):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same)
    return {
        "dlogp": float(np.abs(our_lp - ref_lp).mean()),
        "nll_ref": float(-ref_lp.mean()),
        "nll": float(-our_lp.mean()),
        "top1": float((ref_top == our_top).mean()),
        "prefix": prefix,
        "identical": sum(a == b for a, b in zip(ref["greedy"], ours["greedy"])),
        "tps": ours["tps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", nargs="+", type=Path)
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--no-level0",
        action="store_true",
        help="skip the accuracy-level-0 export (its fp32 "
        "activations run slowly on large models; it only isolates the weights' share)",
    )
    args = parser.parse_args()
    variants = [v for v in VARIANTS if not (args.no_level0 and v[1] == 0)]

    from edge_spec.export.graph.builder import BuildOptions, build_decoder, save_model

    rows = []
    for gguf in args.gguf:
        model, tokenizer, weights, report = load_reference(gguf)
        print(f"{gguf.name}: {report.summary()}", flush=True)
        text_ids = tokenizer.encode(TEXT)
        ref = reference_runs(model, tokenizer, text_ids, args.tokens, args.threads)
        rows.append((gguf.stem, "transformers fp32", None, ref["tps"]))
        with tempfile.TemporaryDirectory() as tmp:
            for blocks, level in variants:
                options = BuildOptions(
                    "int4",
                    accuracy_level=level,
                    context_length=1024,
                    gguf_blocks=blocks != "requantize",
                    carry_exact=blocks == "carry-exact",
                    carry_narrow=blocks == "carry-small",
                )
                path = Path(tmp) / f"{blocks}{level}.onnx"
                save_model(build_decoder(weights, options), path)
                result = compare(ref, onnx_runs(path, tokenizer, text_ids, args.tokens, args.threads), text_ids)
                rows.append((gguf.stem, f"{blocks}, accuracy {level}", result, result["tps"]))
                print(f"  {blocks}, accuracy level {level}: done", flush=True)
        del model

    print(
        f"\n| model | export | mean abs dlogp | NLL (ref) | top-1 agree | greedy tokens equal to transformers "
        f"(first difference, per prompt of {args.tokens}) | identical prompts | tok/s ({args.threads} threads) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, variant, r, tps in rows:
        if r is None:
            print(f"| {name} | {variant} | | | | | | {tps:.1f} |")
            continue
        print(
            f"| {name} | {variant} | {r['dlogp']:.4f} | {r['nll']:.4f} ({r['nll_ref']:.4f}) | {r['top1']:.3f} | "
            f"{'/'.join(map(str, r['prefix']))} | {r['identical']}/{len(PROMPTS)} | {tps:.1f} |"
        )


if __name__ == "__main__":
    main()
