"""Greedy decoding of a bundle's drafter model (body + full head) on the CPU EP and on WebGPU, token by token:
the first divergence and the CPU logit margin there, and the host<->device bytes per token on WebGPU.

    python benchmarks/webgpu_parity.py BUNDLE [--tokens 64] [--rows 1]

The drafter stands in for the target where the GPU is slow (lavapipe); ``--role target`` runs the target.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from edge_spec.manifest import read_manifest
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.model.session import small_session
from edge_spec.runtime.text import TextTokenizer

PROMPT = "Write a Python function that checks whether a number is prime."


def greedy(bundle: Path, role: str, provider: str, ids: list[int], tokens: int, rows: int):
    manifest = read_manifest(bundle)
    decoder = Decoder(
        bundle / manifest[role]["onnx"], provider=provider, capacity=len(ids) + tokens + 8, min_rows=rows, threads=0
    )
    head = None
    if role == "draft":
        head = small_session(bundle / manifest["draft"]["heads"]["full"]["onnx"], provider, 0)
    out, all_logits = [], []
    result = decoder.prefill(ids)
    started = time.perf_counter()
    for _ in range(tokens):
        logits = (
            result["logits"][-1]
            if head is None
            else head.run(None, {"hidden_states": result["hidden_states"][-1][None, None]})[0][0, 0]
        )
        all_logits.append(logits)
        out.append(int(np.argmax(logits)))
        result = decoder.forward([out[-1]], 1)
    return out, all_logits, decoder.transfers, (time.perf_counter() - started) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1, help="min_rows of every pass (1: plain one-row decoding)")
    parser.add_argument("--role", default="draft", choices=("draft", "target"))
    args = parser.parse_args()
    tokenizer = TextTokenizer(args.bundle)
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    cpu, cpu_logits, _, cpu_s = greedy(args.bundle, args.role, "cpu", ids, args.tokens, args.rows)
    gpu, gpu_logits, transfers, gpu_s = greedy(args.bundle, args.role, "webgpu", ids, args.tokens, args.rows)
    first = next((i for i, (a, b) in enumerate(zip(cpu, gpu)) if a != b), None)
    print(f"prompt {len(ids)} tokens, {args.tokens} generated, passes of >= {args.rows} rows")
    print(f"CPU {cpu_s * 1000:.0f} ms/token, WebGPU {gpu_s * 1000:.0f} ms/token (a smoke run on lavapipe, not a speed)")
    if first is None:
        print(f"identical greedy answers: {tokenizer.decode(cpu)!r}")
    else:
        top = np.sort(cpu_logits[first])[-2:]
        print(
            f"first divergence at token {first}: CPU {cpu[first]} / WebGPU {gpu[first]}, CPU margin "
            f"{top[1] - top[0]:.3f}, WebGPU logit gap there {gpu_logits[first][gpu[first]] - gpu_logits[first][cpu[first]]:.3f}"
        )
        print(f"  shared prefix: {tokenizer.decode(cpu[:first])!r}")
    per = transfers.passes or 1
    print(
        f"WebGPU host->device {transfers.host_to_device / per:.0f} B/pass, device->host "
        f"{transfers.device_to_host / per:.0f} B/pass, KV {transfers.kv} B in all, over {transfers.passes} passes"
    )
    print(
        f"max |logit| difference CPU vs WebGPU over the shared prefix: "
        f"{max(float(np.abs(a - b).max()) for a, b in zip(cpu_logits[: first or None], gpu_logits[: first or None])):.3f}"
    )


if __name__ == "__main__":
    main()
