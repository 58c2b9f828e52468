"""What the grammar costs a constrained answer: grammar time per emitted token, compiles per answer, tok/s.

Each JSON-schema prompt of ``schemas.jsonl`` (the first ``--prompts``) is answered greedily with
``response_format`` json_schema (strict), in each mode of ``--modes``, interleaved prompt by prompt.
The grammar's work is timed where it happens: every call into a :class:`Constraint` (its masks, its
advances and roll-backs, its forced tokens; a call made from inside another is counted once, in the
outer one) and every compile of a grammar (each new matcher of ``constrain.compile``), with
``time.perf_counter``.  Per mode it prints the tokens, the grammar milliseconds per emitted token, the
masks the grammar engine computed per emitted token, the compiles per answer, the decode tokens/s and a
digest of the token ids (the same code gives the same digest; two versions of the code that must decode
alike must print the same digests).

To compare two versions of the code, run this same script with each on ``PYTHONPATH``, back to back:

    PYTHONPATH=OLD python benchmarks/constrained_mask.py --bundle BUNDLE --threads 2
    PYTHONPATH=NEW python benchmarks/constrained_mask.py --bundle BUNDLE --threads 2
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import time
from pathlib import Path

SCHEMAS = Path(__file__).with_name("schemas.jsonl")


class GrammarClock:
    """Seconds spent in the grammar engine's layer, and compiles, while installed (see the module docstring)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.compile_seconds = 0.0
        self.compiles = 0
        self.masks = 0  # masks the grammar engine computed (``Constraint.library_allowed``)
        self._depth = 0

    def install(self) -> None:
        from edge_spec.runtime.constrain import compile as compile_module
        from edge_spec.runtime.constrain.constraint import Constraint

        for name, member in list(vars(Constraint).items()):
            if callable(member) and not name.startswith("__"):
                setattr(Constraint, name, self._timed(member, counts_mask=name == "library_allowed"))
        compile_module.LLMatcher = self._compiling(compile_module.LLMatcher)

    def _timed(self, method, counts_mask: bool = False):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            self.masks += counts_mask
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1
                self._depth -= 1

        return timed

    def _compiling(self, matcher_class):
        def compiled(*args, **kwargs):
            started = time.perf_counter()
            try:
                return matcher_class(*args, **kwargs)
            finally:
                self.compile_seconds += time.perf_counter() - started
                self.compiles += 1

        return compiled

    def reading(self) -> tuple[float, int, float, int, int]:
        return self.seconds, self.calls, self.compile_seconds, self.compiles, self.masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default="spec,ar", help="comma-separated engine modes (spec, ar)")
    parser.add_argument("--prompts", type=int, default=8, help="the first N prompts of schemas.jsonl")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json", action="store_true", help="also print one JSON line of the totals")
    args = parser.parse_args()

    import edge_spec
    from edge_spec.runtime.engine import Engine

    clock = GrammarClock()
    clock.install()
    items = [json.loads(line) for line in SCHEMAS.read_text().splitlines() if line.strip()][: args.prompts]
    modes = [m for m in args.modes.split(",") if m]
    engine = Engine.from_bundle(args.bundle, threads=args.threads)
    print(f"code: {Path(edge_spec.__file__).parent}")
    print(f"bundle: {args.bundle}  threads: {args.threads}  prompts: {len(items)}  max_tokens: {args.max_tokens}")
    warm = [{"role": "user", "content": "Say hi."}]
    for mode in modes:  # the first answer builds the grammar vocabulary and measures the device
        "".join(engine.generate(warm, max_new_tokens=4, mode=mode, response_format={"type": "json_object"}))
    totals = {
        mode: {"tokens": 0, "grammar_s": 0.0, "calls": 0, "compiles": 0, "masks": 0, "decode_s": 0.0} for mode in modes
    }
    digests = {mode: hashlib.sha256() for mode in modes}
    print(
        f"{'prompt':<14} {'mode':<5} {'tokens':>6} {'grammar ms/tok':>14} {'calls/tok':>9} {'masks/tok':>9} {'compiles':>8} {'tok/s':>7}"
    )
    for item in items:
        fmt = {"type": "json_schema", "json_schema": {"name": item["id"], "schema": item["schema"], "strict": True}}
        messages = [{"role": "user", "content": item["prompt"]}]
        for mode in modes:
            before = clock.reading()
            "".join(engine.generate(messages, max_new_tokens=args.max_tokens, mode=mode, response_format=fmt))
            after = clock.reading()
            stats, tokens = engine.last_stats, list(engine.last_token_ids)
            grammar, calls, compiles = after[0] - before[0], after[1] - before[1], after[3] - before[3]
            masks = after[4] - before[4]
            total = totals[mode]
            total["tokens"] += stats.new_tokens
            total["grammar_s"] += grammar
            total["calls"] += calls
            total["compiles"] += compiles
            total["masks"] += masks
            total["decode_s"] += stats.decode_seconds
            total["decoded"] = total.get("decoded", 0) + max(stats.new_tokens - 1, 0)  # the first: the prefill's
            digests[mode].update(json.dumps(tokens).encode())
            print(
                f"{item['id']:<14} {mode:<5} {stats.new_tokens:>6} {1000 * grammar / max(stats.new_tokens, 1):>14.3f} "
                f"{calls / max(stats.new_tokens, 1):>9.2f} {masks / max(stats.new_tokens, 1):>9.2f} {compiles:>8} "
                f"{stats.tokens_per_second:>7.2f}"
            )
    print()
    print(
        f"{'mode':<5} {'tokens':>6} {'grammar ms/tok':>14} {'calls/tok':>9} {'masks/tok':>9} {'compiles/answer':>15} {'tok/s':>7}  digest"
    )
    for mode, total in totals.items():
        tokens = max(total["tokens"], 1)
        total["grammar_ms_per_token"] = 1000 * total["grammar_s"] / tokens
        total["calls_per_token"] = total["calls"] / tokens
        total["masks_per_token"] = total["masks"] / tokens
        total["compiles_per_answer"] = total["compiles"] / len(items)
        total["tokens_per_second"] = total["decoded"] / total["decode_s"] if total["decode_s"] else 0.0
        total["digest"] = digests[mode].hexdigest()[:16]
        print(
            f"{mode:<5} {total['tokens']:>6} {total['grammar_ms_per_token']:>14.3f} {total['calls_per_token']:>9.2f} {total['masks_per_token']:>9.2f} "
            f"{total['compiles_per_answer']:>15.2f} {total['tokens_per_second']:>7.2f}  {total['digest']}"
        )
    if args.json:
        print(json.dumps({"code": str(Path(edge_spec.__file__).parent), "modes": totals}))


if __name__ == "__main__":
    main()
