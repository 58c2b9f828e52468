"""Every decoding mode on a GPU execution provider, one command: ar, spec at fixed γ = 1..4, SpecHub with
k = 2 drafts, and SSD with the drafter on the CPU; tokens/s, speed-up against ar, and host<->device bytes
per generated token (the target's KV cache must not cross: its column must read 0).

    python benchmarks/gpu_modes.py BUNDLE [--provider webgpu] [--tokens 128] [--prompts 4]
        [--provider-option device_id=0] [--draft-threads 2]

On a machine without a GPU (WebGPU over Mesa's lavapipe) this is a smoke run of the modes, not a speed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import ArConfig, ChainConfig, SsdConfig, TreeConfig

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "Summarize what speculative decoding does in three sentences.",
]


def modes() -> list[tuple[str, object, str | None]]:
    """(label, loop configuration, drafter provider override)."""
    out = [("ar", ArConfig(), None)]
    out += [(f"spec γ={g}", ChainConfig(gamma=g, adaptive=False), None) for g in (1, 2, 3, 4)]
    out.append(("spechub k=2 γ=2", TreeConfig(gamma=2, drafts=2, verifier="spechub"), None))
    out.append(("ssd γ=1, drafter on cpu", SsdConfig(gamma=1), "cpu"))
    return out


def run_mode(engine: Engine, config, prompts: list[str], tokens: int) -> tuple[float, int, dict[str, float]]:
    engine.config = config
    engine.complete(prompts[0], max_new_tokens=4)  # warm-up: shader compilation, first allocations
    target = engine.bundle.target
    target.transfers.reset()
    generated, seconds = 0, 0.0
    for prompt in prompts:
        done = engine.complete([{"role": "user", "content": prompt}], max_new_tokens=tokens)
        generated += done.stats.new_tokens
        seconds += done.stats.decode_seconds + done.stats.prefill_seconds
    t = target.transfers
    per = max(generated, 1)
    return (
        generated / seconds,
        generated,
        {"h2d": t.host_to_device / per, "d2h": t.device_to_host / per, "kv": t.kv / per},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--provider", default="webgpu")
    parser.add_argument("--provider-option", action="append", default=[], help="KEY=VALUE (repeatable)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--draft-threads", type=int, default=0)
    parser.add_argument("--only", action="append", default=[], help="run only modes whose label starts so")
    args = parser.parse_args()
    options = dict(pair.split("=", 1) for pair in args.provider_option)
    prompts = PROMPTS[: args.prompts]
    engines: dict[str | None, Engine] = {}
    rows = []
    for label, config, draft_provider in modes():
        if args.only and not any(label.startswith(o) for o in args.only):
            continue
        if draft_provider not in engines:
            engines[draft_provider] = Engine.from_bundle(
                args.bundle,
                provider=args.provider,
                draft_provider=draft_provider,
                provider_options=options,
                draft_threads=args.draft_threads or None,
                mode="spec",
            )
        started = time.perf_counter()
        speed, generated, bytes_per_token = run_mode(engines[draft_provider], config, prompts, args.tokens)
        rows.append((label, speed, generated, bytes_per_token, time.perf_counter() - started))
        print(
            f"{label:26s} {speed:7.2f} tok/s  {generated:5d} tokens  host->device {bytes_per_token['h2d']:9.0f} "
            f"B/token  device->host {bytes_per_token['d2h']:9.0f} B/token  target KV {bytes_per_token['kv']:.0f} "
            f"B/token",
            flush=True,
        )
    base = next((speed for label, speed, *_ in rows if label == "ar"), None)
    if base:
        print("speed-up against ar: " + ", ".join(f"{label} {speed / base:.2f}x" for label, speed, *_ in rows))


if __name__ == "__main__":
    main()
