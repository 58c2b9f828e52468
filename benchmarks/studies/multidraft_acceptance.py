"""Expected first-token acceptance of single-draft, RRS, RRS-without-replacement and SpecHub (k = 2)
on the real model pair, per bench category, without Monte Carlo noise.

Along each prompt the target samples its own continuation (temperature T); at every position the
target's processed distribution p and the drafter's q (through the chosen head) are fed to
:func:`edge_spec.runtime.verify.tree.expected_acceptance`, the exact acceptance probability of each
verifier averaged over how its drafts are drawn.  With branches of length 1 this is the expected
number of accepted tokens per target call (τ - 1), so the table compares the verifiers' tokens per
step directly; `edge-spec bench --modes ar,spec,rrs,rrs-wor,spechub` measures the same loop end to end with
wall-clock.

    python benchmarks/studies/multidraft_acceptance.py BUNDLE --temperature 0.7 --temperature 1.0 --head full
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from edge_spec.bench.runs import load_bench_prompts
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.verify.sampling import SamplingParams, logits_to_probs, sample, scatter_probs
from edge_spec.runtime.verify.tree import expected_acceptance

SCHEMES = ("single", "rrs", "rrs-wor", "spechub")


def measure(engine: Engine, prompts: list[dict], temperature: float, tokens: int, seed: int) -> list[dict]:
    params = SamplingParams(temperature=temperature)
    target, drafter = engine.bundle.target, engine.bundle.drafter
    rows = []
    for index, item in enumerate(tqdm(prompts, desc=f"T={temperature} {engine.bundle.draft_head}")):
        prompt = item["prompt"]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = engine.prompt_ids(messages)
        rng = np.random.default_rng(seed + index)
        target.reset()
        drafter.body.reset()
        target_logits = target.forward(ids)["logits"][-1]
        draft_logits, draft_ids = drafter.next_logits(ids)
        for _ in range(tokens):
            p = logits_to_probs(target_logits, params)
            probs = logits_to_probs(draft_logits, params)
            q = probs if draft_ids is None else scatter_probs(probs, draft_ids, len(p), validate=False)
            rows.append(
                {
                    "category": item["category"],
                    "prompt_index": index,
                    **{s: expected_acceptance(s, q, p) for s in SCHEMES},
                    "q_top": float(q.max()),
                }
            )
            x = sample(p, rng)
            if x in engine.bundle.tokenizer.eos_token_ids:
                break
            ids = ids + [x]
            target_logits = target.forward([x])["logits"][-1]
            draft_logits, draft_ids = drafter.next_logits(ids)
    return rows


def summarize(rows: list[dict]) -> dict[str, dict[str, float]]:
    groups = defaultdict(list)
    for r in rows:
        groups[r["category"]].append(r)
        groups["overall"].append(r)
    return {
        c: {
            **{s: float(np.mean([r[s] for r in g])) for s in SCHEMES},
            "positions": len(g),
            "q_top": float(np.mean([r["q_top"] for r in g])),
        }
        for c, g in sorted(groups.items(), key=lambda kv: (kv[0] == "overall", kv[0]))
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--temperature", type=float, action="append")
    ap.add_argument("--head", action="append", help="drafter heads (default: the bundle's default head)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=Path("bench-results/multidraft-acceptance"))
    args = ap.parse_args()
    engine = Engine.from_bundle(args.bundle, threads=args.threads, mode="ar")
    prompts = load_bench_prompts(None, None, args.per_category)
    results = {}
    for head in args.head or [engine.bundle.draft_head]:
        engine.use_draft_head(head)
        for temperature in args.temperature or [0.7, 1.0]:
            summary = summarize(measure(engine, prompts, temperature, args.tokens, args.seed))
            results[f"{head}@T{temperature}"] = summary
            print(f"\nhead {head}, T = {temperature}: expected accepted first tokens per target call (k = 2)")
            print(
                f"{'category':14s} {'positions':>9s} {'q top':>6s} "
                + " ".join(f"{s:>8s}" for s in SCHEMES)
                + "  spechub-rrs  spechub-wor"
            )
            for category, row in summary.items():
                print(
                    f"{category:14s} {row['positions']:9d} {row['q_top']:6.3f} "
                    + " ".join(f"{row[s]:8.4f}" for s in SCHEMES)
                    + f"  {row['spechub'] - row['rrs']:+11.4f}  {row['spechub'] - row['rrs-wor']:+11.4f}"
                )
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "acceptance.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
