"""SSD against plain speculative decoding and autoregressive decoding with the same total thread budget.

Two engines on the same bundle: one with both sessions on all ``--threads`` (ar and spec alternate the
cores, as they do in production), one with the cores split between target and drafter
(``--target-threads`` + ``--draft-threads``) for ssd, which runs them side by side.  Each prompt is
answered in every mode back to back, so machine noise hits all modes alike; the script prints decode
tokens/s, speed-up vs ar and vs spec, τ and the speculation-cache hit rate per category.

    python benchmarks/studies/ssd_vs_spec.py [BUNDLE] --gamma 1 --threads 2 --target-threads 1 --draft-threads 1
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from edge_spec.bench.runs import load_bench_prompts
from edge_spec.paths import DEFAULT_BUNDLE
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import ChainConfig, SsdConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path, nargs="?", default=DEFAULT_BUNDLE)
    ap.add_argument("--gamma", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="ar and spec: threads of each session")
    ap.add_argument("--target-threads", type=int, default=1, help="ssd: target session threads")
    ap.add_argument("--draft-threads", type=int, default=1, help="ssd: drafter session threads")
    ap.add_argument("--head", default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--per-category", type=int, default=None)
    ap.add_argument("--output", type=Path, default=Path("bench-results/ssd"))
    args = ap.parse_args()
    chain = ChainConfig(gamma=args.gamma, adaptive=False, proposers=("model", "guess"))
    shared = Engine.from_bundle(args.bundle, threads=args.threads, config=chain, draft_head=args.head)
    split = Engine.from_bundle(
        args.bundle,
        threads=args.target_threads,
        draft_threads=args.draft_threads,
        config=SsdConfig(gamma=args.gamma),
        draft_head=args.head,
    )
    runs = [("ar", shared, "ar"), ("spec", shared, "spec"), ("ssd", split, "ssd")]
    for _, engine, mode in runs:
        engine.complete("warm up", max_new_tokens=8, mode=mode)
    records = []
    for index, item in enumerate(tqdm(load_bench_prompts(None, None, args.per_category), desc="prompts")):
        prompt = item["prompt"]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        outputs = {}
        for name, engine, mode in runs:
            done = engine.complete(
                messages, max_new_tokens=args.max_tokens, temperature=args.temperature, seed=index, mode=mode
            )
            outputs[name] = done.token_ids
            records.append(
                {
                    "category": item["category"],
                    "mode": name,
                    "tokens": max(done.stats.new_tokens - 1, 0),
                    "seconds": done.stats.decode_seconds,
                    **{k: getattr(done.stats.spec, k, None) for k in ("tau", "cache_hit_rate", "target_calls")},
                }
            )
        # greedy identity is judged against target-only decoding with the same batch-invariant passes
        # (ar --exact, runtime/decoder.py) on the same sessions
        outputs["ar_split"] = split.complete(
            messages, max_new_tokens=args.max_tokens, temperature=args.temperature, seed=index, mode="ar", exact=True
        ).token_ids
        records[-1]["identical_to_spec"] = outputs["ssd"] == outputs["spec"]
        records[-1]["identical_to_ar_same_threads"] = outputs["ssd"] == outputs["ar_split"]
    groups = defaultdict(list)
    for r in records:
        groups[(r["category"], r["mode"])].append(r)
        groups[("overall", r["mode"])].append(r)
    speed = {k: sum(r["tokens"] for r in v) / sum(r["seconds"] for r in v) for k, v in groups.items()}
    print(
        f"\nγ = {args.gamma}, T = {args.temperature}: ar/spec on {args.threads} threads, ssd on "
        f"{args.target_threads} + {args.draft_threads}"
    )
    print(
        f"{'category':14s} {'ar tok/s':>9s} {'spec x ar':>9s} {'ssd x ar':>9s} {'ssd x spec':>10s} "
        f"{'τ spec':>7s} {'τ ssd':>6s} {'hit rate':>8s}"
    )
    categories = sorted({c for c, _ in groups}, key=lambda c: (c == "overall", c))
    summary = {}
    for c in categories:

        def tau(mode: str) -> float:
            rows = groups[(c, mode)]
            calls = sum(r["target_calls"] for r in rows)
            return sum(r["tau"] * r["target_calls"] for r in rows) / calls if calls else 0.0

        ssd_rows = groups[(c, "ssd")]
        calls = sum(r["target_calls"] for r in ssd_rows)
        hit = sum(r["cache_hit_rate"] * r["target_calls"] for r in ssd_rows) / calls if calls else 0.0
        summary[c] = {
            "ar": speed[(c, "ar")],
            "spec": speed[(c, "spec")],
            "ssd": speed[(c, "ssd")],
            "tau_spec": tau("spec"),
            "tau_ssd": tau("ssd"),
            "hit_rate": hit,
        }
        s = summary[c]
        print(
            f"{c:14s} {s['ar']:9.1f} {s['spec'] / s['ar']:9.2f} {s['ssd'] / s['ar']:9.2f} "
            f"{s['ssd'] / s['spec']:10.2f} {s['tau_spec']:7.2f} {s['tau_ssd']:6.2f} {hit:8.2f}"
        )
    last = [r for r in records if "identical_to_spec" in r]
    print(
        f"ssd output identical to ar --exact on the same thread split on "
        f"{sum(r['identical_to_ar_same_threads'] for r in last)}/{len(last)} prompts, to spec on "
        f"{sum(r['identical_to_spec'] for r in last)}/{len(last)}"
    )
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / f"ssd-g{args.gamma}-t{args.temperature}.json").write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "records": records}, indent=1
        )
    )


if __name__ == "__main__":
    main()
