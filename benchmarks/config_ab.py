"""Two (or more) engine configurations on the same prompts, interleaved per prompt in one process.

Why: on a shared two-core machine the speed drifts by several percent within minutes, as much as a
schedule change moves it; running the configurations back to back on each prompt, in alternating order,
puts the drift on both sides alike.  Each configuration gets an engine of its own (``ar`` one loaded for
target-only decoding, as ``generate --mode ar`` has it); greedy answers are compared token for token.

    python benchmarks/config_ab.py --config g4=spec:gamma=4 --config g8=spec:gamma=8 --config ar=ar \\
        [--prompts edge_spec/data/bench/prompts.jsonl --prompts edge_spec/data/bench/prime.jsonl] [--max-tokens 64]

A configuration is ``NAME=MODE[:SETTING=VALUE,...]`` with ``loop_config``'s settings (gamma, schedule,
lookup, ...) and the sampling settings ``temperature`` (a number: T=0.7 is written ``temperature=0.7``) and
``sampler``; ``bundle=DIR`` loads that configuration from another bundle (two export layouts side by
side); ``native=REV`` registers the native ops built from git revision ``REV``'s sources (or ``native=PATH``,
a built library) in that configuration's sessions, to time a kernel change on whole answers.  ``--seeds N``
answers every prompt N times (seeds 0..N-1, the same for every configuration).
Prints per prompt and per category the decode tokens/s, and each configuration's geometric mean ratio to
the first one and its mean τ.

    python benchmarks/config_ab.py --config rejection=spec:temperature=0.7 \
        --config coupled=spec:temperature=0.7,sampler=coupled --config ar=ar:temperature=0.7 --seeds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_spec.bench.native_builds import build_revision, native_library  # noqa: E402
from edge_spec.bench.runs import load_bench_prompts  # noqa: E402
from edge_spec.paths import DEFAULT_BUNDLE  # noqa: E402
from edge_spec.prompts import as_messages  # noqa: E402
from edge_spec.runtime.engine import Engine  # noqa: E402
from edge_spec.runtime.loops.config import loop_config  # noqa: E402
from edge_spec.runtime.model import huge_pages  # noqa: E402

SAMPLING = {"temperature": float, "sampler": str}  # per-answer settings, not the loop's
ENGINE = {"bundle": Path, "native": str}  # what the engine loads, not the loop's


def parse_config(text: str):
    """``NAME=MODE[:KEY=VALUE,...]`` -> (name, loop configuration, sampling and engine settings)."""
    name, _, spec = text.partition("=")
    mode, _, settings = spec.partition(":")
    values, sampling = {}, {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        if key in SAMPLING or key in ENGINE:
            sampling[key] = {**SAMPLING, **ENGINE}[key](value)
            continue
        values[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    return name, loop_config(mode, **values), sampling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--config", action="append", required=True, help="NAME=MODE[:KEY=VALUE,...] (repeatable)")
    parser.add_argument("--prompts", action="append", type=Path, help="prompt files (default: the bench prompts)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=1, help="answers per prompt (seeds 0..N-1 for every config)")
    parser.add_argument(
        "--empty-suffix-cache",
        action="store_true",
        help="empty each engine's suffix cache before each answer, as the peer benchmarks do (else each keeps its "
        "earlier answers, as a server's would)",
    )
    args = parser.parse_args()
    parsed = [parse_config(text) for text in args.config]
    sampling = {name: {k: v for k, v in settings.items() if k not in ENGINE} for name, _, settings in parsed}
    with tempfile.TemporaryDirectory(prefix="edge-spec-config-ab-") as scratch:
        engines = {name: load_engine(settings, args, config, Path(scratch) / name) for name, config, settings in parsed}
        run(args, engines, sampling)


def load_engine(settings: dict, args: argparse.Namespace, config, scratch: Path) -> Engine:
    """One configuration's engine, on its own bundle and native build where it names them."""
    bundle = settings.get("bundle", args.bundle)
    if "native" not in settings:
        return Engine.from_bundle(bundle, threads=args.threads, config=config)
    library = Path(settings["native"])
    if not library.is_file():
        scratch.mkdir(parents=True)
        library = build_revision(settings["native"], scratch)
    with native_library(library):
        return Engine.from_bundle(bundle, threads=args.threads, config=config)


def run(args: argparse.Namespace, engines: dict[str, Engine], sampling: dict[str, dict]) -> None:
    """Every prompt in every configuration, in turns; prints speeds, ratios and equal answers."""
    huge_pages.wait_all()  # every engine timed on the pages it keeps (model/huge_pages.py)
    items = [
        (item, seed)
        for path in (args.prompts or [None])
        for item in load_bench_prompts(path, None, None)
        for seed in range(args.seeds)
    ]
    names = list(engines)
    speed: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    taus: dict[str, list[float]] = defaultdict(list)
    same = {name: 0 for name in names}
    for index, (item, seed) in enumerate(items):
        answers = {}
        for name in names if index % 2 == 0 else names[::-1]:
            engine = engines[name]
            if args.empty_suffix_cache:
                engine.bundle.suffix_cache.clear()
            "".join(
                engine.generate(
                    as_messages(item["prompt"]), max_new_tokens=args.max_tokens, seed=seed, **sampling[name]
                )
            )
            answers[name] = list(engine.last_token_ids)
            speed[item["category"]][name].append(engine.last_stats.tokens_per_second)
            if engine.last_stats.spec is not None and engine.last_stats.spec.tau:
                taus[name].append(engine.last_stats.spec.tau)
        for name in names:
            same[name] += answers[name] == answers[names[0]]
        print(index, item["category"], {n: round(speed[item["category"]][n][-1], 1) for n in names}, flush=True)
    overall: dict[str, list[float]] = defaultdict(list)
    for category, by_name in speed.items():
        ratios = {n: [b / a for a, b in zip(by_name[names[0]], by_name[n])] for n in names}
        for n in names:
            overall[n] += ratios[n]
        print(
            f"{category:<15}",
            {n: round(sum(v) / len(v), 1) for n, v in by_name.items()},
            f"/ {names[0]}:",
            {n: round(statistics.geometric_mean(r), 3) for n, r in ratios.items()},
        )
    print(
        f"{'overall':<15} / {names[0]}:",
        {n: round(statistics.geometric_mean(r), 3) for n, r in overall.items()},
        f"answers equal to {names[0]}'s:",
        {n: f"{same[n]}/{len(items)}" for n in names},
    )
    print("mean τ:", {n: round(sum(t) / len(t), 2) for n, t in taus.items()})


if __name__ == "__main__":
    main()
