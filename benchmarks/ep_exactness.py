"""On one execution provider and bundle: which target pass sizes give each row the same logits bit for bit
(the row classes its kernels make), and whether greedy speculative decoding then equals exact target-only
decoding at short and long drafts.

Why: exact greedy speculative decoding pads every target pass to ``providers.exact_min_rows`` rows and
assumes that every pass of at least that many rows computes each row the same way.  That was measured on
the CPU EP and on WebGPU over a software Vulkan driver; a real GPU's kernels may switch paths at other row
counts (tiles of 8 or 16 rows, say), and a long draft would then verify in another class than the pass
the reference decoded with.  This finds out where a GPU is at hand.

    python benchmarks/ep_exactness.py BUNDLE --provider webgpu [--tokens 48] [--answer-tokens 40]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from edge_spec.bench.row_classes import logits_by_pass_size, row_classes
from edge_spec.manifest import read_manifest
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import ChainConfig
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.model.providers import EXACT_MIN_ROWS, exact_min_rows

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 24, 32)
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Repeat after me: one two three four five six seven eight nine ten.",
]


def greedy_equality(engine: Engine, answer_tokens: int, longest: int = 15) -> list[tuple[str, str, bool, float]]:
    """(prompt, schedule, equal to exact target-only, tokens per target pass) per prompt and schedule."""
    schedules = [(f"γ={g}", ChainConfig(gamma=g, adaptive=False)) for g in sorted({1, min(4, longest), longest})]
    schedules.append(("adaptive", ChainConfig(gamma=min(longest, ChainConfig().gamma))))
    out = []
    for prompt in PROMPTS:
        reference = engine.complete(prompt, max_new_tokens=answer_tokens, mode="ar", exact=True).token_ids
        for label, config in schedules:
            engine.config = config
            done = engine.complete(prompt, max_new_tokens=answer_tokens, mode="spec")
            out.append((prompt[:24], label, done.token_ids == reference, done.stats.spec.tau))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--provider", default="webgpu")
    parser.add_argument("--tokens", type=int, default=48, help="rows decoded per pass size")
    parser.add_argument("--answer-tokens", type=int, default=40, help="0: row classes only")
    parser.add_argument("--sizes", type=int, nargs="*", help=f"pass sizes to compare (default: {SIZES})")
    parser.add_argument(
        "--pad",
        type=int,
        default=0,
        help="pad exact passes to this many rows instead of the "
        "provider's minimum (the greedy check then drafts at most pad - 1)",
    )
    args = parser.parse_args()
    manifest = read_manifest(args.bundle)
    reference_rows = exact_min_rows(args.provider)
    decoder = Decoder(args.bundle / manifest["target"]["onnx"], provider=args.provider, capacity=256)
    if args.pad:  # what exact passes would be with this pad instead (longer passes are not padded)
        EXACT_MIN_ROWS[args.provider] = reference_rows = args.pad
    sizes = tuple(args.sizes or SIZES)
    results = logits_by_pass_size(decoder, sizes, args.tokens, pad_to=reference_rows)
    again = logits_by_pass_size(decoder, (reference_rows,), args.tokens, pad_to=reference_rows)[reference_rows]
    del decoder
    repeat = "the same" if np.array_equal(again, results.get(reference_rows, again)) else "NOT the same"
    print(
        f"row classes on {args.provider}, passes padded to {reference_rows} rows (sizes whose rows agree bit "
        f"for bit; a repeat of the "
        f"{reference_rows}-row passes gave {repeat} logits):"
    )
    reference = results.get(reference_rows)
    for group in row_classes(results):
        rows = results[group[0]]
        n = min(len(rows), len(reference)) if reference is not None else 0
        apart = f"up to {np.max(np.abs(rows[:n] - reference[:n])):.3g} from {reference_rows}-row passes" if n else ""
        print(f"  {{{', '.join(map(str, group))}}} {apart}", flush=True)
    if args.answer_tokens <= 0:
        return
    engine = Engine.from_bundle(args.bundle, provider=args.provider, mode="spec")
    print(f"the engine's own check: padded passes batch-invariant here: {engine.bundle.exact_available()}")
    engine.bundle._padded_exact = True  # measure what the pad gives even where the check refuses exact mode
    print(
        f"greedy spec against ar --exact on {args.provider} (exact passes: {engine.bundle.exact_rows()} rows at least):"
    )
    longest = args.pad - 1 if args.pad else 15
    for prompt, label, equal, per_round in greedy_equality(engine, args.answer_tokens, longest):
        print(
            f"  {prompt!r:28s} {label:9s} {'equal' if equal else 'DIFFERENT':9s} {per_round:.2f} tokens/pass",
            flush=True,
        )


if __name__ == "__main__":
    main()
