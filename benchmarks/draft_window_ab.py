"""How many of a long prompt's last tokens the drafter model should read: windows interleaved per prompt.

The drafter reads only the tail of a long prompt (``propose.model.DRAFT_CONTEXT``).  A longer window costs
prompt time before the first token and makes every draft step attend over more cache; a shorter one may
draft worse.  Each long bench prompt (``--category long``) is answered greedily by the default mode (the
suffix cache on, emptied before every answer) once per window, back to back in one process so that a shared
machine's drift falls on every window alike; the order of the windows turns from prompt to prompt, since the
draft schedule carries what it learned from one answer into the next.  Prints per answer and pooled: decode
tokens/s, prompt seconds (target and drafter) and tau.  ``--chars`` cuts each code file shorter, for the
window on prompts of a few hundred tokens (``--chars 1800``: 250-480 tokens).

    python benchmarks/draft_window_ab.py [--bundle BUNDLE] [--windows 1024,512,256] [--max-tokens 128] [--chars N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_spec.bench.long_prompts import CHAR_BUDGET, long_prompts  # noqa: E402
from edge_spec.bench.runs import modes_for, run_bench  # noqa: E402
from edge_spec.paths import DEFAULT_BUNDLE  # noqa: E402
from edge_spec.runtime.engine import Engine  # noqa: E402
from edge_spec.runtime.loops.config import loop_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--windows", default="1024,512,256", help="drafter windows, in tokens (comma list)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chars", type=int, default=CHAR_BUDGET, help="code characters per prompt at most")
    args = parser.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    chain = loop_config("spec", lookup=False)
    engine = Engine.from_bundle(args.bundle, threads=args.threads, config=chain)
    baseline = Engine.from_bundle(args.bundle, threads=args.threads, mode="ar")
    for warm in (engine, baseline):
        warm.complete("warm up", max_new_tokens=4)
    modes = modes_for(engine, [engine.bundle.draft_head], chain, [], suffix=True, reference=False)
    (mode,) = [m for m in modes if "suffix" in m.name]
    drafter = engine.bundle.active_drafter(mode.config)
    pooled = {w: [0, 0.0, 0.0, 0] for w in windows}  # tokens, decode s, prompt s, answers
    for number, item in enumerate(long_prompts(args.chars)):
        shift = number % len(windows)  # each window goes first as often: an answer's schedule learns from the last
        for window in windows[shift:] + windows[:shift]:
            drafter.context = window
            engine.bundle.target.rewind(0)
            drafter.rewind(0)
            (record,) = run_bench(
                engine, [item], [mode], temperatures=[0.0], max_new_tokens=args.max_tokens, baseline=baseline
            )["records"]
            stats = engine.last_stats
            total = pooled[window]
            total[0] += stats.new_tokens - 1
            total[1] += stats.decode_seconds
            total[2] += stats.prefill_seconds
            total[3] += 1
            print(
                f"prompt {number} ({stats.prompt_tokens} tokens), window {window}: {record['tokens_per_second']:.1f} tok/s, "
                f"prompt {stats.prefill_seconds:.2f} s, tau {stats.spec.tau:.2f}",
                flush=True,
            )
    for window, (tokens, decode, prompt, answers) in pooled.items():
        print(f"window {window}: decode {tokens / decode:.2f} tok/s pooled, prompt {prompt / answers:.2f} s mean")


if __name__ == "__main__":
    main()
