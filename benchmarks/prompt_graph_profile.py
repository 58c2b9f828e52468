"""Where does reading a long prompt through a prompt reader go?  ORT's profiler, grouped by op type.

Reads the first long bench prompt (``edge_spec.bench.long_prompts``) through the bundle's target prompt graph
(``export --prompt-reader``) in 512-row passes into a float32 cache, as ``Decoder.prefill`` does, once with its
attention on ONNX Runtime's ``GroupQueryAttention`` and once on the native op's prompt path (where this CPU has
one: AMX), each in a session of its own, and prints the kernel seconds per op type:

    python benchmarks/prompt_graph_profile.py --bundle BUNDLE [--threads 2] [--top 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from edge_spec.bench.long_prompts import long_prompts
from edge_spec.manifest import read_manifest
from edge_spec.runtime.model.decoder import PREFILL_CHUNK
from edge_spec.runtime.model.native_attention import native_library, prompt_path, use_native_attention
from edge_spec.runtime.text import TextTokenizer


def profiled_session(graph: Path, threads: int, native: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp(prefix="edge-spec-prompt-")) / "prompt")
    model: str | bytes = str(graph)
    if native:
        proto = onnx.load(str(graph), load_external_data=False)
        use_native_attention(proto, bf16_products=True)
        options.register_custom_ops_library(str(native_library("cpu")))
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(graph.parent))
        model = proto.SerializeToString()
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def read(session: ort.InferenceSession, ids: list[int], capacity: int) -> float:
    """Seconds to read ``ids`` in passes of PREFILL_CHUNK rows, the cache bound in place."""
    names = {i.name for i in session.get_inputs()}
    shapes = {i.name: i.shape for i in session.get_inputs()}
    cache = {
        name: np.zeros((1, shapes[name][1], capacity, shapes[name][3]), np.float32)
        for name in names
        if name.startswith("past_key_values.")
    }
    started, done = time.perf_counter(), 0
    while done < len(ids):
        rows = min(PREFILL_CHUNK, len(ids) - done)
        total = done + rows
        feeds = {
            "input_ids": np.array([ids[done:total]], np.int64),
            "seqlens_k": np.array([total - 1], np.int32),
            "total_sequence_length": np.array(total, np.int32),
            "num_logits": np.array([1], np.int64),
            "position_ids": np.arange(done, total, dtype=np.int64)[None],
            "attention_bias": np.zeros((1, 1, rows, total), np.float32),
        }
        binding = session.io_binding()
        for name, value in feeds.items():
            if name in names:
                binding.bind_cpu_input(name, value)
        for name, value in cache.items():
            binding.bind_cpu_input(name, value)
        for output in session.get_outputs():
            if output.name.startswith("present."):
                past = cache["past_key_values." + output.name.removeprefix("present.")]
                binding.bind_output(output.name, "cpu", 0, np.float32, list(past.shape), past.ctypes.data)
            else:
                binding.bind_output(output.name, "cpu")
        session.run_with_iobinding(binding)
        done = total
    return time.perf_counter() - started


def kernel_seconds(session: ort.InferenceSession) -> Counter:
    events = json.loads(Path(session.end_profiling()).read_text())
    by_op: Counter = Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            by_op[event["args"]["op_name"]] += event["dur"] / 1e6
    return by_op


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    manifest = read_manifest(args.bundle)
    reader = manifest["target"].get("prompt_reader")
    if not reader:
        raise SystemExit(f"{args.bundle} has no prompt reader: export it with --prompt-reader")
    graph = args.bundle / reader["onnx"]
    ids = TextTokenizer(args.bundle).encode_chat([{"role": "user", "content": long_prompts()[0]["prompt"]}])
    capacity = -(-len(ids) // PREFILL_CHUNK) * PREFILL_CHUNK
    library = native_library("cpu")
    path = prompt_path(library) if library is not None else ""
    runs = [("ONNX Runtime's attention", False)] + ([(f"native attention ({path})", True)] if path else [])
    print(f"{args.bundle.name}: a {len(ids)}-token prompt, {args.threads} threads, passes of {PREFILL_CHUNK} rows")
    for name, native in runs:
        session = profiled_session(graph, args.threads, native)
        wall = read(session, ids, capacity)
        by_op = kernel_seconds(session)
        kernels = sum(by_op.values())
        print(f"{name}: {wall:.2f} s wall (profiled), {kernels:.2f} s in kernels")
        for op, seconds in by_op.most_common(args.top):
            print(f"  {op:34s} {seconds:6.3f} s  {100 * seconds / kernels:5.1f}%")
    if not path:
        print("this CPU has no prompt path for the native op (no AMX): prompt graphs keep ONNX Runtime's attention")


if __name__ == "__main__":
    main()
