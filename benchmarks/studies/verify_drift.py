"""How far multi-row verify logits drift from one-row decode logits, per MatMulNBits accuracy level.

Why: greedy speculative output equals autoregressive output only if a verify pass over several
positions scores each position exactly as a one-token step would.  With int8 activations
(accuracy level 4) ONNX Runtime's kernels round differently for one row and several rows; this
measures the drift, the argmax flips it causes, and what an fp32-activation build costs instead.

    python benchmarks/studies/verify_drift.py [BUNDLE] --levels 4,1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import onnx

from edge_spec.paths import DEFAULT_BUNDLE
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.text import TextTokenizer

PROMPTS = [
    "Write a Python function that merges two sorted lists.",
    "Explain why the sky is blue in three sentences.",
    "Translate to German: I would like two tickets for the evening show.",
]


def with_accuracy_level(model_path: Path, level: int) -> Path:
    """A copy of the graph (same external weights file) with every MatMulNBits at ``level``."""
    model = onnx.load(str(model_path), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = level
    out = model_path.with_name(f"model_acc{level}.onnx")
    onnx.save(model, str(out))
    return out


def measure(path: Path, tokenizer: TextTokenizer, threads: int, new_tokens: int, rows: int) -> str:
    decoder = Decoder(path, threads=threads, capacity=1024, takes_turns=True)
    flips = checked = 0
    drift = 0.0
    one_row, many_rows = [], []
    for prompt in PROMPTS:
        ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": prompt}]))
        decoder.reset()
        logits = decoder.forward(ids, 1)["logits"][-1]
        generated, reference = [], []
        for _ in range(new_tokens):  # greedy decoding one token at a time: the reference
            generated.append(int(np.argmax(logits)))
            started = time.perf_counter()
            logits = decoder.forward([generated[-1]], 1)["logits"][-1]
            one_row.append(time.perf_counter() - started)
            reference.append(logits)
        decoder.rewind(len(ids))
        decoder.forward([generated[0]], 1)
        for k in range(1, new_tokens - rows + 1, rows):  # the same positions, `rows` at a time
            started = time.perf_counter()
            out = decoder.forward(generated[k : k + rows], rows)["logits"]
            many_rows.append(time.perf_counter() - started)
            for j in range(rows):
                drift = max(drift, float(np.abs(out[j] - reference[k + j]).max()))
                flips += int(np.argmax(out[j]) != np.argmax(reference[k + j]))
                checked += 1
    return (
        f"max |logit drift| {drift:.5f}, argmax flips {flips}/{checked}, "
        f"1-row pass {1e3 * np.median(one_row):.1f} ms, {rows}-row pass {1e3 * np.median(many_rows):.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", nargs="?", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--levels", default="4,1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rows", type=int, default=4)
    args = parser.parse_args()
    tokenizer = TextTokenizer(args.bundle)
    model = args.bundle / "target" / "model.onnx"
    for level in (int(v) for v in args.levels.split(",")):
        path = model if level == 4 else with_accuracy_level(model, level)
        try:
            print(f"accuracy level {level}: {measure(path, tokenizer, args.threads, args.tokens, args.rows)}")
        finally:
            if path != model:
                path.unlink()


if __name__ == "__main__":
    main()
