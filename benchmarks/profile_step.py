"""Where does one decode step of the exported target go?  ORT's profiler, grouped by op type.

Runs the bundle's target decoder (``Decoder``: GQA with the shared KV buffer bound
through IOBinding, exactly as the engine runs it) with
``SessionOptions.enable_profiling``, does one prefill of the chat prompt and
``--steps`` single-token greedy decode steps, then parses ORT's profile JSON:

* every ``*_kernel_time`` event is attributed to the ``model_run`` it falls in;
* per decode step: ms and % of the wall step time per op type, the weight matmuls
  split by projection (qkv / o / gate_up / down / lm_head), the top nodes, and
  "non-op overhead" = wall step time (``Decoder.forward`` as Python sees it)
  minus the summed kernel times, split into what ORT's ``model_run`` spends
  outside kernels (executor, fences, allocation) and what lies outside
  ``model_run`` (IOBinding, Python, numpy).

Profiling adds some cost per node; the same steps are also timed on a session
without profiling, for comparison.

Usage::

    .venv/bin/python benchmarks/profile_step.py [--bundle DIR] [--threads 2] [--steps 64] [--context N] [--keep-json]

``--context N`` decodes after a prompt of N tokens (the chat prompt after repeated source text) instead of
the short chat prompt: what attention over the cache adds to a step grows with N, and on long prompts
(an edit of a whole file) it decides how fast a step is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from edge_spec.bench.ort_profile import (  # noqa: E402
    bundle_target,
    matmul_weight_bytes,
    parse_profile,
    profiled_decoder,
    role_of,
)
from edge_spec.manifest import read_manifest  # noqa: E402
from edge_spec.paths import DEFAULT_BUNDLE  # noqa: E402
from edge_spec.runtime.model.decoder import Decoder  # noqa: E402
from edge_spec.runtime.model.native_attention import QUANTIZED_MATMULS  # noqa: E402
from edge_spec.runtime.text import TextTokenizer  # noqa: E402

PROMPT = "Write a Python function that checks whether a number is prime."


def run_steps(decoder: Decoder, prompt_ids: list[int], steps: int) -> tuple[float, list[float]]:
    """Prefill + ``steps`` greedy single-token forwards; returns (prefill s, [wall s per decode step])."""
    decoder.reset()
    start = time.perf_counter()
    logits = decoder.prefill(prompt_ids)["logits"][-1]
    prefill = time.perf_counter() - start
    walls = []
    for _ in range(steps):
        token = int(np.argmax(logits))
        start = time.perf_counter()
        logits = decoder.forward([token])["logits"][-1]
        walls.append(time.perf_counter() - start)
    return prefill, walls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--skip", type=int, default=2, help="first decode steps left out of the averages (warm-up)")
    parser.add_argument("--top", type=int, default=8, help="how many individual nodes to list")
    parser.add_argument("--context", type=int, default=0, help="decode after a prompt of this many tokens")
    parser.add_argument("--keep-json", action="store_true", help="keep ORT's profile JSON and print its path")
    args = parser.parse_args()

    manifest = read_manifest(args.bundle)
    onnx_path, kernels = bundle_target(args.bundle)
    tokenizer = TextTokenizer(args.bundle)
    prompt_ids = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": PROMPT}]))
    capacity = 4096
    if args.context:
        if not len(prompt_ids) <= args.context <= capacity - args.steps - 8:
            raise SystemExit(f"--context must lie between {len(prompt_ids)} and {capacity - args.steps - 8}")
        filler = tokenizer.encode(Path(__file__).read_text())
        while len(prompt_ids) < args.context:
            prompt_ids += filler[: args.context - len(prompt_ids)]

    # ---- unprofiled reference: same prefill + steps on a plain session
    plain = Decoder(onnx_path, threads=args.threads, capacity=capacity)
    run_steps(plain, prompt_ids[:8], 4)  # warm-up
    plain_prefill, plain_walls = run_steps(plain, prompt_ids, args.steps)
    del plain

    # ---- profiled session
    decoder = profiled_decoder(onnx_path, args.threads, capacity)
    run_steps(decoder, prompt_ids[:8], 4)  # same warm-up (its 5 runs are dropped from the profile below)
    prefill, walls = run_steps(decoder, prompt_ids, args.steps)
    profile = Path(decoder.session.end_profiling())
    runs = parse_profile(profile)
    passes = len(runs) - 5 - args.steps  # the prompt is read in passes of at most the decoder's prefill chunk
    if passes < 1:
        raise SystemExit(f"expected at least {5 + 1 + args.steps} model_run events in {profile}, found {len(runs)}")
    runs = runs[5:]
    weight_bytes = matmul_weight_bytes(onnx_path)

    decode_runs = runs[passes + args.skip :]
    decode_walls = walls[args.skip :]
    n = len(decode_runs)
    wall_ms = sum(decode_walls) / n * 1e3
    run_ms = sum(r["dur"] for r in decode_runs) / n / 1e3
    by_op: dict[str, float] = defaultdict(float)
    count_op: dict[str, int] = defaultdict(int)
    by_role: dict[str, float] = defaultdict(float)
    count_role: dict[str, int] = defaultdict(int)
    by_node: dict[tuple[str, str], float] = defaultdict(float)
    bytes_role: dict[str, int] = defaultdict(int)
    for r in decode_runs:
        for node, op, dur in r["kernels"]:
            by_op[op] += dur
            count_op[op] += 1
            by_node[(node, op)] += dur
            if op in QUANTIZED_MATMULS:
                by_role[role_of(node)] += dur
                count_role[role_of(node)] += 1
                bytes_role[role_of(node)] += weight_bytes.get(node, 0)
    ms = lambda us: us / n / 1e3  # noqa: E731  (µs summed over n steps -> ms per step)
    kernel_ms = ms(sum(by_op.values()))

    print(f"model: {onnx_path.relative_to(ROOT) if onnx_path.is_relative_to(ROOT) else onnx_path}")
    q = manifest["target"].get("quantization", {})
    print(
        f"       {manifest['target']['name']}, {q.get('weights')} block {q.get('block_size')} "
        f"acc level {q.get('accuracy_level')}; ORT {ort.__version__}, {args.threads} threads, "
        f"{len(prompt_ids)} prompt tokens, {args.steps} decode steps (first {args.skip} skipped -> {n} averaged)"
    )
    if kernels:
        print(f"       {kernels}")
    print(
        f"unprofiled session : prefill {plain_prefill * 1e3:7.1f} ms, decode "
        f"{statistics.mean(plain_walls[args.skip :]) * 1e3:6.2f} ms/step "
        f"(median {statistics.median(plain_walls[args.skip :]) * 1e3:.2f}) = "
        f"{1 / statistics.mean(plain_walls[args.skip :]):.2f} tok/s"
    )
    print(
        f"profiled session   : prefill {prefill * 1e3:7.1f} ms, decode {wall_ms:6.2f} ms/step "
        f"(median {statistics.median(decode_walls) * 1e3:.2f}) = {1e3 / wall_ms:.2f} tok/s"
    )
    print()

    header = f"{'op type':<36} {'nodes/step':>10} {'ms/step':>9} {'% of step':>9}"
    print("per decode step, by op type (profiled session; % of the wall step time)")
    print(header)
    print("-" * len(header))
    for op, us in sorted(by_op.items(), key=lambda kv: -kv[1]):
        print(f"{op:<36} {count_op[op] / n:10.0f} {ms(us):9.3f} {ms(us) / wall_ms * 100:8.1f}%")
    print("-" * len(header))
    print(
        f"{'sum of kernels':<36} {sum(count_op.values()) / n:10.0f} {kernel_ms:9.3f} {kernel_ms / wall_ms * 100:8.1f}%"
    )
    print(
        f"{'non-op overhead inside model_run':<36} {'':>10} {run_ms - kernel_ms:9.3f} "
        f"{(run_ms - kernel_ms) / wall_ms * 100:8.1f}%"
    )
    print(
        f"{'non-op overhead outside model_run':<36} {'':>10} {wall_ms - run_ms:9.3f} "
        f"{(wall_ms - run_ms) / wall_ms * 100:8.1f}%"
    )
    print(
        f"{'non-op overhead (wall - kernels)':<36} {'':>10} {wall_ms - kernel_ms:9.3f} "
        f"{(wall_ms - kernel_ms) / wall_ms * 100:8.1f}%"
    )
    print(f"{'total (wall step time)':<36} {'':>10} {wall_ms:9.3f} {100.0:8.1f}%")
    print()

    print("weight matmuls by projection (MB = weights and scales read per step; GB/s = MB / kernel time)")
    print(header.replace("op type", "projection") + f" {'MB':>7} {'GB/s':>6}")
    print("-" * (len(header) + 15))
    for role, us in sorted(by_role.items(), key=lambda kv: -kv[1]):
        mb = bytes_role[role] / n / 1e6
        print(
            f"{role:<36} {count_role[role] / n:10.0f} {ms(us):9.3f} {ms(us) / wall_ms * 100:8.1f}% "
            f"{mb:7.1f} {mb / ms(us):6.1f}"
        )
    total_mb = sum(bytes_role.values()) / n / 1e6
    mm_ms = ms(sum(by_op[op] for op in QUANTIZED_MATMULS))
    print(
        f"{'all weight matmuls':<36} {sum(count_role.values()) / n:10.0f} {mm_ms:9.3f} "
        f"{mm_ms / wall_ms * 100:8.1f}% {total_mb:7.1f} {total_mb / mm_ms:6.1f}"
    )
    print()

    lm = [(node, us) for (node, op), us in by_node.items() if op in QUANTIZED_MATMULS and "lm_head" in node]
    for node, us in lm:
        print(
            f"LM head: {node}  {ms(us):.3f} ms/step ({ms(us) / wall_ms * 100:.1f}% of the step, "
            f"{ms(us) / kernel_ms * 100:.1f}% of kernel time)"
        )
    print()
    print(f"top {args.top} nodes")
    for (node, op), us in sorted(by_node.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {node:<48} {op:<28} {ms(us):7.3f} ms/step {ms(us) / wall_ms * 100:5.1f}%")

    pre_ops: dict[str, float] = defaultdict(float)
    for prefill_run in runs[:passes]:
        for _, op, dur in prefill_run["kernels"]:
            pre_ops[op] += dur
    print()
    print(
        f"prefill ({len(prompt_ids)} tokens in {passes} passes, profiled): model_run "
        f"{sum(r['dur'] for r in runs[:passes]) / 1e3:.1f} ms; "
        + ", ".join(f"{op} {us / 1e3:.1f} ms" for op, us in sorted(pre_ops.items(), key=lambda kv: -kv[1])[:4])
    )
    if args.keep_json:
        print(f"profile JSON: {profile}")
    else:
        profile.unlink()
        try:
            profile.parent.rmdir()  # the mkdtemp folder the profile prefix pointed into
        except OSError:
            pass


if __name__ == "__main__":
    main()
