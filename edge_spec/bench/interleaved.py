"""Two or more decoders of one target timed in one process, their passes taking turns.

A change to a graph or a kernel is priced against what it replaces on the same machine at the same moment:
on a shared 2-core machine speed drifts by 5-25% from one minute to the next, so only passes that alternate
between the two sides compare.  The decoders should be opened with ``takes_turns=True``, so that the idle
one's thread pool stops spinning and leaves the cores to the one that runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from edge_spec.manifest import read_manifest
from edge_spec.runtime.loaded import set_bundle_kernels
from edge_spec.runtime.model.decoder import Decoder


def pass_study_parser(description: str, *, context: int, rows: list[int], repeats: int) -> argparse.ArgumentParser:
    """The arguments every study of passes after a prompt takes: the bundle, threads, the prompt's length, the
    rows of each timed pass and how many passes of each."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=context, help="prompt tokens before the timed passes")
    parser.add_argument("--rows", type=int, nargs="+", default=rows, help="rows of each timed pass")
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser


def study_target(args: argparse.Namespace) -> tuple[Path, int]:
    """(the bundle's target graph, its context length), once the prompt and the passes are known to fit it; the
    native op's prefetch choices set as a load of the bundle sets them."""
    manifest = read_manifest(args.bundle)
    set_bundle_kernels(manifest)
    capacity = manifest["context_length"]
    if min(args.rows) < 1 or args.context + max(args.rows) + 1 > capacity:
        raise SystemExit(
            f"--rows must be 1 or more, and --context plus the most rows fit the bundle's context of {capacity} tokens"
        )
    return args.bundle / manifest["target"]["onnx"], capacity


def fastest_reads(
    decoders: Mapping[str, Decoder], ids: Sequence[int], repeats: int
) -> tuple[dict[str, float], dict[str, int]]:
    """(seconds each decoder takes to read ``ids`` from an empty cache, the fastest of ``repeats`` reads, the
    decoders' order reversed every other repeat; the greedy next token each read gives)."""
    best = {name: float("inf") for name in decoders}
    tokens: dict[str, int] = {}
    order = list(decoders.items())
    for repeat in range(repeats):
        for name, decoder in order if repeat % 2 == 0 else order[::-1]:
            decoder.reset()
            start = time.perf_counter()
            logits = decoder.prefill(list(ids))["logits"]
            best[name] = min(best[name], time.perf_counter() - start)
            tokens[name] = int(np.argmax(logits.reshape(-1, logits.shape[-1])[-1]))
    return best, tokens


def random_ids(rng: np.random.Generator, count: int) -> list[int]:
    """``count`` token ids drawn from the vocabulary's common middle (a pass's time does not depend on which)."""
    return [int(t) for t in rng.integers(100, 20000, count)]


def interleaved_passes(
    decoders: Mapping[str, Decoder],
    context: Sequence[int],
    rows: Sequence[int],
    repeats: int,
    rng: np.random.Generator,
    *,
    logit_rows: int | None = None,
    warm_up: int = 2,
) -> dict[str, dict[int, float]]:
    """Median seconds of a pass of each count in ``rows`` after ``context``, per decoder.

    Each decoder reads ``context`` once; then every repeat gives each decoder a pass of the same new tokens,
    rewound to ``context`` before it, the decoders' order reversed every other repeat so that neither always
    runs first.  ``logit_rows``: rows of logits a pass asks for (None: every row, as a verify pass; 1: a
    prompt read's pass).  The first ``warm_up`` repeats are left out of the medians."""
    for decoder in decoders.values():
        decoder.reset()
        decoder.prefill(list(context))
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in rows} for name in decoders}
    order = list(decoders.items())
    for repeat in range(warm_up + repeats):
        for n in rows:
            ids = random_ids(rng, n)
            for name, decoder in order if repeat % 2 == 0 else order[::-1]:
                decoder.rewind(len(context))
                started = time.perf_counter()
                decoder.forward(ids, n if logit_rows is None else logit_rows)
                if repeat >= warm_up:
                    times[name][n].append(time.perf_counter() - started)
    return {name: {n: statistics.median(t) for n, t in by_rows.items()} for name, by_rows in times.items()}


def fastest_prefill(
    decoders: Mapping[str, Decoder], tokens: int, repeats: int, rng: np.random.Generator
) -> dict[str, float]:
    """Fastest of ``repeats`` reads of one random ``tokens``-token prompt (in the decoder's prefill passes), per
    decoder, the decoders taking turns."""
    prompt = random_ids(rng, tokens)
    best = dict.fromkeys(decoders, float("inf"))
    for _ in range(repeats):
        for name, decoder in decoders.items():
            decoder.reset()
            started = time.perf_counter()
            decoder.prefill(prompt)
            best[name] = min(best[name], time.perf_counter() - started)
    return best
