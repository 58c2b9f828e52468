"""Autoregressive decode speed: our exported int4 target vs onnxruntime-genai on the same weights.

One run prints, side by side, the greedy decode tokens/s of

* **edge-spec**: ``Engine.from_bundle(bundle, threads=2)`` in ``mode="ar"``, and
* **onnxruntime-genai**: its model builder's int4 CPU export of the *same* GGUF
  weights (dequantized once to a Hugging Face checkpoint), run by its own
  ``Generator`` loop,

both on 2 intra-op threads, the same chat prompt (token ids computed once by our
tokenizer and handed to both), 128 new tokens, after one short warm-up
generation each; the timed runs alternate between the two engines (both stay
loaded) so that drift in the shared machine's speed hits both alike.  tokens/s is measured the same way for both: (new tokens - 1)
divided by the time from the first new token (which comes out of the prefill)
to the last.

onnxruntime-genai lives in its own virtual environment (``models/genai-venv``,
created on first use) because it pins its own onnxruntime and a newer
transformers; this script re-runs itself there with ``--genai-worker`` and reads
each run's result back as a JSON line on stdout.

Artifacts are cached, so only the first run is slow (minutes):

* ``models/hf/<name>/``      GGUF dequantized to a float32 HF checkpoint + tokenizer
* ``models/genai-venv/``     onnxruntime-genai + its builder's dependencies
* ``models/genai/<name>/``   the builder's output (``-p int4 -e cpu``, block 32, accuracy level 4)

Usage::

    .venv/bin/python benchmarks/ar_vs_ortgenai.py            # prepare (once) + benchmark
    .venv/bin/python benchmarks/ar_vs_ortgenai.py --repeats 5 --new-tokens 128 --threads 2 [--bundle DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m"
GENAI_DIR = ROOT / "models" / "genai" / NAME
GENAI_CACHE = ROOT / "models" / "genai" / "cache"
GENAI_VENV = ROOT / "models" / "genai-venv"
GENAI_PY = GENAI_VENV / "bin" / "python"
# what the genai venv needs: the runtime, and the model builder's imports (its builder wants transformers 5)
GENAI_REQUIREMENTS = ["onnxruntime-genai==0.18.0", "torch==2.13.0", "transformers>=5", "onnx", "onnx-ir"]

PROMPT = "Write a Python function that checks whether a number is prime."
WARMUP_TOKENS = 8

# measured earlier on this machine (2 cores, AVX2, no VNNI), quoted from the issue for context
REFERENCE = [
    ("llama.cpp (Q4_K_M GGUF)", 12.65),
    ("optimum export + numpy KV loop", 10.5),
    ("onnxruntime-genai (earlier measurement)", 8.3),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- preparation (cached)


def ensure_hf_checkpoint(name: str = NAME) -> Path:
    """GGUF -> float32 HF checkpoint (transformers' GGUF loader dequantizes Q4_K/Q6_K exactly into fp32).
    ``name``: a GGUF in models/gguf/ (without .gguf); the checkpoint goes to models/hf/<name>/."""
    gguf, out = ROOT / "models" / "gguf" / f"{name}.gguf", ROOT / "models" / "hf" / name
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    log(f"converting {gguf.name} to a Hugging Face checkpoint in {out} (once)")
    code = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, f, out = {str(gguf.parent)!r}, {gguf.name!r}, {str(out)!r}
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
model.save_pretrained(out, safe_serialization=True)
tok.save_pretrained(out)
"""
    # a child process, so the ~6 GB of fp32 weights are freed before anything is timed
    subprocess.run([sys.executable, "-c", code], check=True)
    return out


def ensure_venv(venv: Path, requirements: list[str], modules: str) -> None:
    """A virtual environment with ``requirements`` installed, unless ``import <modules>`` works there already."""
    python = venv / "bin" / "python"
    if (
        python.is_file()
        and subprocess.run([str(python), "-c", f"import {modules}"], capture_output=True).returncode == 0
    ):
        return
    log(f"creating {venv} with {' '.join(requirements)} (once)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements], check=True)


def ensure_genai_venv() -> None:
    ensure_venv(GENAI_VENV, GENAI_REQUIREMENTS, "onnxruntime_genai, transformers, torch, onnx_ir")


def ensure_genai_model(threads: int, name: str = NAME) -> Path:
    """The builder's int4 CPU export of models/gguf/<name>.gguf in models/genai/<name>/."""
    out = ROOT / "models" / "genai" / name
    if (out / "genai_config.json").is_file() and (out / "model.onnx").is_file():
        return out
    hf = ensure_hf_checkpoint(name)
    log(f"running the onnxruntime-genai model builder into {out} (once; takes minutes)")
    cmd = [
        str(GENAI_PY),
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(hf),
        "-o",
        str(out),
        "-p",
        "int4",
        "-e",
        "cpu",
        "-c",
        str(GENAI_CACHE),
        "--extra_options",
        "accuracy_level=4",
        "block_size=32",
    ]
    log(" ".join(cmd))
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    log(f"builder done in {time.perf_counter() - started:.0f} s")
    return out


# --------------------------------------------------------------------------- onnxruntime-genai side


def load_genai_model(og, model_dir: str, threads: int, blocks: tuple[str, ...] = ("decoder",)):
    """An onnxruntime-genai model on the CPU, each of ``blocks`` (``decoder``; ``draft`` for a speculative
    config) on ``threads`` intra-op threads."""
    config = og.Config(model_dir)
    config.clear_providers()  # CPU
    session = {"session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}
    config.overlay(json.dumps({"model": {block: session for block in blocks}}))
    return og.Model(config)


def genai_worker() -> None:
    """Runs inside models/genai-venv.  Protocol on stdin/stdout, one JSON object a line:
    spec in -> {"ready"} out (after load + warm-up); then each "run" in -> one timed generation out."""
    import onnxruntime_genai as og

    spec = json.loads(sys.stdin.readline())
    model = load_genai_model(og, spec["model_dir"], spec["threads"])
    tokenizer = og.Tokenizer(model)
    eos = set(int(t) for t in list(tokenizer.eos_token_ids))
    prompt = spec["prompt_ids"]

    def run(n_new: int) -> dict:
        params = og.GeneratorParams(model)
        # min_length = max_length: EOS is masked until the budget is spent, so every run is exactly n_new tokens
        total = len(prompt) + n_new
        params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=1)
        gen = og.Generator(model, params)
        start = time.perf_counter()
        gen.append_tokens(prompt)  # prefill
        gen.generate_next_token()  # first token: picked from the prefill's logits
        first = time.perf_counter()
        n = 1
        while not gen.is_done():
            gen.generate_next_token()  # one decode step + greedy pick
            n += 1
        end = time.perf_counter()
        ids = [int(t) for t in gen.get_sequence(0)][len(prompt) :]
        return {
            "new_tokens": n,
            "prefill_seconds": first - start,
            "decode_seconds": end - first,
            "tokens_per_second": (n - 1) / (end - first) if n > 1 else 0.0,
            "text": tokenizer.decode(ids),
            "first_eos_at": next((i for i, t in enumerate(ids) if t in eos), None),
        }

    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    run(WARMUP_TOKENS)
    reply({"ready": True, "version": og.__version__})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        reply(run(spec["new_tokens"]))


class GenaiSide:
    """The worker process in models/genai-venv, kept alive so its runs can alternate with ours."""

    def __init__(self, prompt_ids: list[int], args) -> None:
        self.proc = subprocess.Popen(
            [str(GENAI_PY), str(Path(__file__).resolve()), "--genai-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        spec = {
            "model_dir": str(GENAI_DIR),
            "prompt_ids": prompt_ids,
            "threads": args.threads,
            "new_tokens": args.new_tokens,
        }
        self.version = self._ask(json.dumps(spec))["version"]

    def _ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise SystemExit(f"onnxruntime-genai worker failed (exit {self.proc.wait()})")
        return json.loads(answer)

    def run(self) -> dict:
        return self._ask("run")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# --------------------------------------------------------------------------- edge-spec side


class OursSide:
    def __init__(self, args) -> None:
        sys.path.insert(0, str(ROOT))
        from edge_spec.paths import DEFAULT_BUNDLE  # here, not at the top: the genai worker has no edge_spec
        from edge_spec.runtime.engine import Engine

        self.args = args
        self.bundle = args.bundle or DEFAULT_BUNDLE
        self.engine = Engine.from_bundle(self.bundle, threads=args.threads, mode="ar")
        self.messages = [{"role": "user", "content": PROMPT}]
        self.prompt_ids = self.engine.prompt_ids(self.messages)
        self.engine.complete(self.messages, max_new_tokens=WARMUP_TOKENS, temperature=0.0)  # warm-up
        self.note = ""

    def run(self) -> dict:
        n_new = self.args.new_tokens
        self.engine.bundle.target.reset()  # full prefill every run (the engine would otherwise reuse the cached prompt)
        c = self.engine.complete(self.messages, max_new_tokens=n_new, temperature=0.0)
        s = c.stats
        if s.new_tokens >= n_new:
            return {
                "new_tokens": s.new_tokens,
                "prefill_seconds": s.prefill_seconds,
                "decode_seconds": s.decode_seconds,
                "tokens_per_second": s.tokens_per_second,
                "text": c.text,
            }
        # the answer ended (EOS) early: time the same target with the bare token loop, which ignores EOS
        import numpy as np

        from edge_spec.runtime.loops.autoregressive import generate_autoregressive
        from edge_spec.runtime.loops.request import Request
        from edge_spec.runtime.verify.sampling import SamplingParams

        self.note = f"engine stopped at EOS after {s.new_tokens} tokens; timed with the bare AR loop instead"
        target = self.engine.bundle.target
        target.reset()
        start = time.perf_counter()
        loop = generate_autoregressive(
            Request(target, [], self.prompt_ids, SamplingParams(temperature=0.0), np.random.default_rng(0), n_new)
        )
        next(loop)
        first = time.perf_counter()
        n = 1 + sum(1 for _ in loop)
        end = time.perf_counter()
        return {
            "new_tokens": n,
            "prefill_seconds": first - start,
            "decode_seconds": end - first,
            "tokens_per_second": (n - 1) / (end - first),
            "text": c.text,
        }


# --------------------------------------------------------------------------- report


def summarize(name: str, result: dict) -> dict:
    tps = [r["tokens_per_second"] for r in result["runs"]]
    return {
        "engine": name,
        "median": statistics.median(tps),
        "best": max(tps),
        "all": tps,
        "new_tokens": result["runs"][-1]["new_tokens"],
        "prefill_ms": statistics.median(r["prefill_seconds"] for r in result["runs"]) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, help="our bundle (default: the default export)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed generations per engine (median reported)")
    parser.add_argument("--prepare-only", action="store_true", help="build the cached artifacts and stop")
    parser.add_argument("--genai-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.genai_worker:  # we are the child, inside models/genai-venv
        genai_worker()
        return

    ensure_genai_venv()
    ensure_genai_model(args.threads)
    if args.prepare_only:
        return

    load = os.getloadavg()
    log("loading + warming up edge-spec")
    ours_side = OursSide(args)
    log("loading + warming up onnxruntime-genai (in models/genai-venv)")
    genai_side = GenaiSide(ours_side.prompt_ids, args)
    prompt_ids = ours_side.prompt_ids
    ours, genai = {"runs": []}, {"runs": [], "version": genai_side.version}
    log(f"timing {args.repeats} x {args.new_tokens} tokens per engine, alternating, {args.threads} threads")
    try:
        for _ in range(args.repeats):  # alternate, so drift in machine speed hits both alike
            ours["runs"].append(ours_side.run())
            genai["runs"].append(genai_side.run())
    finally:
        genai_side.close()
    ours.update(text=ours["runs"][-1]["text"], note=ours_side.note)
    genai.update(text=genai["runs"][-1]["text"], first_eos_at=genai["runs"][-1]["first_eos_at"])
    load_after = os.getloadavg()

    rows = [summarize("edge-spec (ours, AR)", ours), summarize(f"onnxruntime-genai {genai['version']}", genai)]
    base = rows[0]["median"]
    print()
    print(
        f"prompt: {PROMPT!r} via the chat template ({len(prompt_ids)} prompt tokens), greedy, "
        f"{args.new_tokens} new tokens, {args.threads} threads, median of {args.repeats} alternating runs after 1 warm-up each"
    )
    print(
        f"load average 1/5/15 min: before {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}, "
        f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}  (machine has {os.cpu_count()} cores)"
    )
    sizes = [
        sum(f.stat().st_size for f in d.glob("model.onnx*")) / 2**30 for d in (ours_side.bundle / "target", GENAI_DIR)
    ]
    print(
        f"on-disk model: ours {sizes[0]:.2f} GiB (int4 embedding via GatherBlockQuantized), "
        f"genai {sizes[1]:.2f} GiB (builder default: fp32 embedding table)"
    )
    print()
    header = f"{'engine':<44} {'tok/s':>7} {'best':>7} {'vs ours':>8} {'prefill ms':>11} {'tokens':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['engine']:<44} {r['median']:7.2f} {r['best']:7.2f} {r['median'] / base:7.2f}x "
            f"{r['prefill_ms']:11.0f} {r['new_tokens']:7d}"
        )
    print()
    print("reference numbers from the issue (measured earlier on this machine, not in this run):")
    for name, tps in REFERENCE:
        print(f"  {name:<42} {tps:7.2f} {tps / base:7.2f}x")
    print()
    for r in rows:
        print(f"{r['engine']}: all runs tok/s = {', '.join(f'{t:.2f}' for t in r['all'])}")
    paired = [g / o for g, o in zip(rows[1]["all"], rows[0]["all"])]
    print(
        f"paired ratio genai/ours, run by run (robust to drift in machine speed): median "
        f"{statistics.median(paired):.3f}, range {min(paired):.3f}-{max(paired):.3f}"
    )
    if ours["note"]:
        print(f"note (ours): {ours['note']}")
    if genai.get("first_eos_at") is not None:
        print(
            f"note (genai): its greedy answer would have ended at token {genai['first_eos_at']}; "
            f"EOS was masked (min_length) to time all {args.new_tokens}"
        )
    print()
    print("ours, first 160 chars:  " + repr(ours["text"][:160]))
    print("genai, first 160 chars: " + repr(genai["text"][:160]))


if __name__ == "__main__":
    main()
