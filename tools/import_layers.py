"""Check that imports inside ``edge_spec.runtime`` run one way: aio -> engine -> generation -> loaded -> provenance ->
loops -> schedule -> propose -> options -> model/verify/constrain (the three at the bottom independent of one another).

Prints every runtime module's imports of other runtime layers and exits 1 on an import that runs back
up (a lower layer importing a higher one).  ``python tools/import_layers.py``
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "edge_spec" / "runtime"
# rank of each layer: a module may import layers of lower rank (and its own layer)
LAYERS = {
    "aio": 9,
    "engine": 8,
    "generation": 7,
    "loaded": 6,
    "provenance": 5,
    "suffix_store": 5,
    "text": 0,
    "loops": 4,
    "schedule": 3,
    "propose": 2,
    "options": 2,
    "model": 1,
    "verify": 1,
    "constrain": 1,
    "logprobs": 0,
    "progress": 0,
    "heap": 0,
    "latency_curve": 0,
}  # loaded: what loading a bundle produces and the device facts (the engine generates with it);
# provenance: the engine's per-token sources (reads loops.stats and text);
# suffix_store: where the engine's suffix cache lives (reads propose.suffix_cache);
# logprobs: token log-probabilities from a row (numpy only), read by the loops and the engine;
# generation: the parts the engine is made of (loading, turns, prompt, prefill, text stream, stats);
# options: what a caller sets per answer, and the runtime's defaults;
# aio: the engine for asyncio applications; progress: a load's progress and cancellation; heap: memory back;
# latency_curve: how a pass-latency curve is read between and past its points (the profile, the cost model
# and the decoder's live prices read it alike)
BOTTOM = ("model", "verify", "constrain")  # rank 1: none of them imports another


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["edge_spec", "runtime"] or len(parts) < 3:
        return None
    return parts[2]


def main() -> int:
    bad = []
    edges = set()
    for path in sorted(RUNTIME.rglob("*.py")):
        relative = path.relative_to(RUNTIME)
        here = relative.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            target = layer_of(names[0]) or (layer_of(names[1]) if len(names) > 1 else None)
            if target is None or target == here:
                continue
            edges.add((here, target))
            if LAYERS[target] >= LAYERS[here] and not (LAYERS[here] == LAYERS[target] == 1):
                bad.append(f"{relative}: imports {names[0]} ({here} -> {target} runs back up)")
            if here in BOTTOM and target in BOTTOM and here != target:
                bad.append(f"{relative}: imports {names[0]} ({', '.join(BOTTOM)} are independent)")
    for here, target in sorted(edges, key=lambda e: (-LAYERS[e[0]], e[0], e[1])):
        print(f"{here:9s} -> {target}")
    for line in bad:
        print("BACKWARD:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
