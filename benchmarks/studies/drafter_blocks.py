"""Which quantization blocks should the drafter get?  Its step cost and its acceptance, bundle by bundle.

The drafter's rounding moves acceptance only, never the output, so its block size is a speed trade:
larger blocks make ORT's int8-activation kernel cheaper per weight, and round the weights coarser.
Give bundles that differ only in their drafter (export the same pair with ``--draft-block-size 32`` /
``64`` / ``128``); this measures, for each:

* the drafter body's one-token step alone (``Decoder`` on ``draft/body.onnx`` after a 40-token prompt,
  median of ``--steps``), the bundles taking turns ``--rounds`` times so that a drift of the machine
  reaches them all alike; with ``--evict-mb`` that many MB are written between steps, as a target pass
  streams its weights between two drafter steps and pushes the drafter's out of the caches (a cloud CPU's
  last-level cache can hold the whole drafter, a laptop's cannot);
* with ``--prompt-tokens``: reading a prompt of that many tokens (median of ``--steps // 8``);
* with ``--acceptance``: fixed γ = ``--gamma``, no lookup, over the bench prompts as chat messages, as
  ``bench`` sends them (deterministic when greedy, since the target is the same): τ, acceptance at
  each draft position, and a whole draft step in the loop (body, head, Python).

    python benchmarks/studies/drafter_blocks.py BUNDLE_32 BUNDLE_128 [--acceptance] [--temperature 0.7]
    python benchmarks/studies/drafter_blocks.py BUNDLE OTHER --evict-mb 512 --prompt-tokens 64
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from edge_spec.bench.runs import load_bench_prompts
from edge_spec.manifest import read_manifest
from edge_spec.prompts import as_messages
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import loop_config
from edge_spec.runtime.model.decoder import Decoder

PROMPT_TOKENS = 40


def drafter_blocks(bundle: Path) -> str:
    """How the bundle's drafter body is rounded: Q4_K under the native op, or MatMulNBits' blocks of N."""
    quantization = read_manifest(bundle)["draft"]["quantization"]
    return quantization.get("body") or f"blocks of {quantization['block_size']}"


def step_median_ms(body: Decoder, steps: int, evict: np.ndarray | None = None) -> float:
    """Median one-token step after a fixed prompt (the first steps left out: caches warming), ``evict``
    written before each step where given."""
    body.reset()
    body.forward(list(range(100, 100 + PROMPT_TOKENS)), 1)
    times = []
    for i in range(steps):
        if evict is not None:
            evict += 1.0
        started = time.perf_counter()
        body.forward([200 + i], 1)
        times.append(time.perf_counter() - started)
    return 1e3 * float(np.median(times[5:]))


def prompt_median_ms(body: Decoder, tokens: int, repeats: int) -> float:
    """Median time to read a prompt of ``tokens`` tokens into an empty cache."""
    times = []
    for _ in range(repeats):
        body.reset()
        started = time.perf_counter()
        body.forward(list(range(100, 100 + tokens)), 1, prefill=True)
        times.append(time.perf_counter() - started)
    return 1e3 * float(np.median(times))


def acceptance(bundle: Path, gamma: int, temperature: float, threads: int, max_tokens: int) -> str:
    engine = Engine.from_bundle(
        bundle, threads=threads, config=loop_config("spec", schedule="fixed", gamma=gamma, lookup=False)
    )
    accepted, steps, draft_seconds = [], 0, 0.0
    sampled = {} if temperature == 0 else {"seed": 7, "sampler": "coupled"}
    for item in load_bench_prompts(None, None, None):
        summary = engine.complete(
            as_messages(item["prompt"]), max_new_tokens=max_tokens, temperature=temperature, **sampled
        ).stats.spec
        accepted += summary.accepted_lengths
        steps += summary.draft_steps
        draft_seconds += summary.draft_seconds
    lengths = np.array(accepted)
    by_position = [float(np.mean(lengths[lengths >= i] >= i + 1)) for i in range(gamma)]
    return (
        f"τ {1 + lengths.mean():.3f} over {len(lengths)} rounds, acceptance by position "
        f"{' / '.join(f'{a:.3f}' for a in by_position)}, draft step in the loop {1e3 * draft_seconds / steps:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--acceptance", action="store_true", help="also fixed-γ acceptance over the bench prompts")
    parser.add_argument("--evict-mb", type=int, default=0, help="MB written between steps (0: none)")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="also time reading a prompt this long")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    blocks = {bundle: drafter_blocks(bundle) for bundle in args.bundles}
    bodies = {
        bundle: Decoder(bundle / read_manifest(bundle)["draft"]["onnx"], threads=args.threads, takes_turns=True)
        for bundle in args.bundles
    }
    evict = np.ones(args.evict_mb * 2**20 // 8) if args.evict_mb else None
    for turn in range(args.rounds):
        parts = []
        for bundle, body in bodies.items():
            part = f"{blocks[bundle]}: step {step_median_ms(body, args.steps, evict):.2f} ms"
            if args.prompt_tokens:
                read = prompt_median_ms(body, args.prompt_tokens, max(args.steps // 8, 3))
                part += f", {args.prompt_tokens}-token prompt {read:.1f} ms"
            parts.append(part)
        print(f"round {turn + 1}: " + "; ".join(parts), flush=True)
    del bodies
    if args.acceptance:
        for bundle in args.bundles:
            print(
                f"{bundle} ({blocks[bundle]}), γ {args.gamma}, T {args.temperature}: "
                f"{acceptance(bundle, args.gamma, args.temperature, args.threads, args.max_tokens)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
