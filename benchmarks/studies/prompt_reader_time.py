"""How long a bundle's target takes to read each long bench prompt through its decode graph alone and through
its int8 prompt graph (``export --prompt-reader``), in one process.

The runtime loads a prompt graph only where it reads prompts sooner (``runtime.loaded.prompt_reader_pays``);
this measures that, whatever the runtime would choose here: both decoders stay loaded, each prompt is read
``--repeats`` times with the order alternating so that drift hits both alike, and the fastest read of each is
kept.  It also says whether the two give the same next token.

    python benchmarks/studies/prompt_reader_time.py --bundle BUNDLE --threads 2 [--repeats 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edge_spec.bench.interleaved import fastest_reads
from edge_spec.bench.long_prompts import long_prompts
from edge_spec.manifest import read_manifest
from edge_spec.runtime.loaded import set_bundle_kernels  # the prefetch choices a load of the bundle sets
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.text import TextTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    manifest = read_manifest(args.bundle)
    set_bundle_kernels(manifest)
    record = manifest["target"].get("prompt_reader")
    if record is None:
        raise SystemExit(f"{args.bundle} has no prompt graph: export it with --prompt-reader")
    target = args.bundle / manifest["target"]["onnx"]
    decoders = {
        "decode graph": Decoder(target, threads=args.threads, capacity=manifest["context_length"]),
        "prompt graph": Decoder(
            target, threads=args.threads, capacity=manifest["context_length"], prompt_graph=args.bundle / record["onnx"]
        ),
    }
    tokenizer = TextTokenizer(args.bundle)
    print("| prompt tokens | decode graph, s | prompt graph, s | decode / prompt | the same next token |")
    print("|---|---|---|---|---|")
    for prompt in long_prompts():
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt["prompt"]}])
        best, tokens = fastest_reads(decoders, ids, args.repeats)
        ratio = best["decode graph"] / best["prompt graph"]
        same = "yes" if len(set(tokens.values())) == 1 else "no"
        print(
            f"| {len(ids)} | {best['decode graph']:.2f} | {best['prompt graph']:.2f} | {ratio:.3f} | {same} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
