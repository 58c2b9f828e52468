"""Bytes against fidelity for the target's carried layouts, and the peers' export, on one text.

For one GGUF file, transformers' fp32 forward of its weights is the reference (as in ``gguf_fidelity.py``).
Each layout is built as a target graph (int8 activations, as shipped) and compared teacher-forced on a
905-token text (``gguf_fidelity.TEXT`` and the start of Python's ``json/decoder.py``): mean |Δ log p|,
NLL and top-1 agreement, plus greedy tokens equal to transformers' on four chat prompts; and its size.

Layouts: the ``--gguf-layout`` values (``native``, ``compact``, ``fast``, ``lean``, ``small``, ``exact``),
two halves of ``small`` that no flag asks for, to show where its loss comes from: ``head4`` (only the LM head's
8-bit blocks rounded to 4 bits) and ``layers4`` (only the layers'), and ``native-q6k4-mid``: ``compact``'s
rounding over all but the first and last three layers. ``--genai DIR`` adds onnxruntime-genai's
model-builder export (``benchmarks/spec_peers.py --prepare`` makes it), run by plain onnxruntime,
teacher-forced only; ``--openvino DIR`` OpenVINO GenAI's (``optimum-cli`` int4) export, run in its own
environment by OpenVINO's CPU plugin with the settings OpenVINO GenAI runs it with (its defaults), teacher-forced
only; ``--llamacpp BUILD`` llama.cpp's own computation with the GGUF file (``llamacpp_logits.cc`` compiled against
that llama.cpp build's static libraries, its default context settings), teacher-forced only; ``--layouts ""``
measures the peers alone. ``--prompt-reader LAYOUT`` adds that layout with its
prompt graph (``export --prompt-reader``): the text and the prompts read through the int8 prompt graph as the runtime reads them (its
attention on the native op's AMX path where the CPU has one), the answers decoded by the layout's graph.

    python benchmarks/studies/layout_fidelity.py models/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --layouts fast,lean,head4,layers4,small --genai models/genai/qwen2.5-coder-1.5b-instruct-q4_k_m
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import gguf_fidelity as shared
import numpy as np

HALVES = {"head4": lambda name: name == "lm_head", "layers4": lambda name: name != "lm_head"}
#: the compact layout's rounding (the layers' Q6_K parts to Q4_K) over all but the first and last three layers
#: (``native-q6k4-mid``), which no flag asks for: whether those layers' Q6_K parts carry its loss
COMPACT_MIDDLE = "native-q6k4-mid"


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "layers" else None


def compact_middle(carried: dict) -> dict:
    """``carried`` with the Q6_K blocks of all layers but the first and last three rounded to Q4_K."""
    from edge_spec.export.gguf.blocks import round_q6k_to_q4k

    layers = 1 + max((i for i in map(_layer, carried) if i is not None), default=-1)

    def middle(name: str) -> bool:
        layer = _layer(name)
        return layer is not None and 3 <= layer < layers - 3

    return {name: round_q6k_to_q4k(w) if w is not None and middle(name) else w for name, w in carried.items()}


def fidelity_text(tokenizer) -> list[int]:
    source = Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py"
    return tokenizer.encode(shared.TEXT + "\n" + source.read_text()[:3000])


def build_layout(weights, layout: str, path: Path) -> float:
    """Write ``layout``'s target graph to ``path``; its size in MiB."""
    from edge_spec.export.bundle.options import layout_settings
    from edge_spec.export.gguf.blocks import narrow_to_4bit
    from edge_spec.export.graph.builder import BuildOptions, build_decoder, save_model

    carried = weights.carried
    if layout in HALVES:
        weights.carried = {k: narrow_to_4bit(v) if HALVES[layout](k) else v for k, v in carried.items()}
        settings = {}
    elif layout == COMPACT_MIDDLE:
        weights.carried = compact_middle(carried)
        settings = layout_settings("native")
    else:
        settings = layout_settings(layout)
    try:
        save_model(build_decoder(weights, BuildOptions("int4", context_length=2048, **settings)), path)
    finally:
        weights.carried = carried
    return sum(f.stat().st_size for f in path.parent.glob(path.name + "*")) / 2**20


def genai_logits(folder: Path, ids: list[int], threads: int) -> np.ndarray:
    """onnxruntime-genai's export, teacher-forced in one pass from an empty cache."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    for item in session.get_inputs():
        if item.name.startswith("past_key_values"):  # newer exports leave the sizes symbolic in the graph
            kv_heads = decoder["num_key_value_heads"] if isinstance(item.shape[1], str) else item.shape[1]
            head = decoder["head_size"] if isinstance(item.shape[3], str) else item.shape[3]
            feeds[item.name] = np.zeros((1, kv_heads, 0, head), np.float32)
    return session.run(["logits"], feeds)[0][0]


OPENVINO_LOGITS = """
import sys, numpy as np, openvino as ov
ids = np.load(sys.argv[2])
core = ov.Core()
model = core.compile_model(sys.argv[1] + "/openvino_model.xml", "CPU", {"INFERENCE_NUM_THREADS": int(sys.argv[4])})
request = model.create_infer_request()
feeds = {"input_ids": ids[None], "attention_mask": np.ones((1, len(ids)), np.int64)}
names = {port.any_name for port in model.inputs}
if "position_ids" in names:
    feeds["position_ids"] = np.arange(len(ids), dtype=np.int64)[None]
if "beam_idx" in names:
    feeds["beam_idx"] = np.zeros(1, np.int32)
request.infer(feeds)
np.save(sys.argv[3], request.get_tensor("logits").data[0].astype(np.float32))
"""


def openvino_logits(folder: Path, ids: list[int], threads: int) -> np.ndarray:
    """OpenVINO GenAI's export, teacher-forced in one pass from an empty state, in the interpreter of the
    environment ``spec_peers.py --prepare`` made for it (``models/openvino-venv``, beside ``models/openvino``)."""
    python = folder.parent.parent / "openvino-venv" / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "ids.npy", np.array(ids, np.int64))
        subprocess.run(
            [str(python), "-c", OPENVINO_LOGITS, str(folder), f"{tmp}/ids.npy", f"{tmp}/logits.npy", str(threads)],
            check=True,
        )
        return np.load(Path(tmp) / "logits.npy")


def llamacpp_logits(build: Path, gguf: Path, ids: list[int], threads: int) -> np.ndarray:
    """llama.cpp's logits of ``gguf`` (the GGUF's own blocks, as llama.cpp computes with them), teacher-forced
    in one decode: ``llamacpp_logits.cc`` compiled against the static libraries of ``build`` (the llama.cpp
    build ``spec_peers.py --prepare`` makes, ``models/llamacpp/build``) and run with its default settings."""
    source = Path(next(line for line in (build / "CMakeCache.txt").read_text().splitlines()
                       if line.startswith("CMAKE_HOME_DIRECTORY")).split("=", 1)[1])  # fmt: skip
    libraries = ["src/libllama.a", "ggml/src/libggml.a", "ggml/src/libggml-cpu.a", "ggml/src/libggml-base.a"]
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "llamacpp_logits"
        command = ["g++", "-O2", "-std=c++17", f"-I{source / 'include'}", f"-I{source / 'ggml' / 'include'}",
                   "-o", str(program), str(Path(__file__).with_name("llamacpp_logits.cc")),
                   *(str(build / name) for name in libraries), "-fopenmp", "-lpthread"]  # fmt: skip
        subprocess.run(command, check=True)
        np.array(ids, np.int32).tofile(Path(tmp) / "ids.i32")
        subprocess.run([str(program), str(gguf), f"{tmp}/ids.i32", str(threads), f"{tmp}/logits.f32"], check=True)
        return np.fromfile(Path(tmp) / "logits.f32", np.float32).reshape(len(ids), -1)


def prompt_reader_row(layout: str, path: Path, reference: dict, tokenizer, ids: list[int], args) -> tuple:
    """``layout`` with its prompt graph derived beside it, compared as the runtime reads prompts with it."""
    from edge_spec.export.graph.prompt_reader import write_prompt_graph
    from edge_spec.runtime.model.native_attention import native_library, prompt_path

    prompt = write_prompt_graph(path)
    size = sum(f.stat().st_size for f in path.parent.glob("*.onnx*")) / 2**20
    library = native_library("cpu")
    attention = (prompt_path(library) if library is not None else "") or "ORT"
    runs = shared.onnx_runs(path, tokenizer, ids, args.tokens, args.threads, prompt_graph=prompt)
    print(f"  {layout} + prompt reader: done", flush=True)
    return (f"{layout} + prompt reader ({attention} attention)", size, shared.compare(reference, runs, ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--layouts", default="fast,lean,head4,layers4,small")
    parser.add_argument("--genai", type=Path, help="onnxruntime-genai's export of the same GGUF")
    parser.add_argument("--openvino", type=Path, help="OpenVINO GenAI's export of the same GGUF")
    parser.add_argument("--llamacpp", type=Path, help="a llama.cpp build folder: its logits of the GGUF itself")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-reader", metavar="LAYOUT", help="also measure LAYOUT read through its prompt graph")
    args = parser.parse_args()

    model, tokenizer, weights, report = shared.load_reference(args.gguf)
    print(f"{args.gguf.name}: {report.summary()}", flush=True)
    ids = fidelity_text(tokenizer)
    reference = shared.reference_runs(model, tokenizer, ids, args.tokens, args.threads)
    del model
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in filter(None, args.layouts.split(",")):
            path = Path(tmp) / layout / "model.onnx"
            path.parent.mkdir()
            size = build_layout(weights, layout, path)
            result = shared.compare(reference, shared.onnx_runs(path, tokenizer, ids, args.tokens, args.threads), ids)
            rows.append((layout, size, result))
            print(f"  {layout}: done", flush=True)
            if layout == args.prompt_reader:
                rows.append(prompt_reader_row(layout, path, reference, tokenizer, ids, args))
            for f in path.parent.iterdir():
                f.unlink()
    peers = (  # name, the folder asked for, its logits, its files on disk
        ("onnxruntime-genai export", args.genai, lambda f: genai_logits(f, ids, args.threads),
         lambda f: f.glob("model.onnx*")),
        ("OpenVINO GenAI export", args.openvino, lambda f: openvino_logits(f, ids, args.threads),
         lambda f: f.glob("openvino_model.*")),
        ("llama.cpp (the GGUF itself)", args.llamacpp, lambda f: llamacpp_logits(f, args.gguf, ids, args.threads),
         lambda f: [args.gguf]),
    )  # fmt: skip
    for name, folder, logits_of, files_of in peers:
        if folder:  # teacher-forced only: no greedy answers
            result = shared.compare(reference, {"logits": logits_of(folder), "greedy": [], "tps": 0.0}, ids)
            rows.append((name, sum(f.stat().st_size for f in files_of(folder)) / 2**20, result))

    print(f"\n{len(ids)} tokens teacher-forced; greedy: {len(shared.PROMPTS)} prompts of {args.tokens} tokens")
    print(
        "| target | size, MiB | mean abs dlogp | NLL (reference) | NLL vs reference | top-1 agreement | greedy tokens equal |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, size, r in rows:
        greedy = " / ".join(map(str, r["prefix"])) or "-"
        print(
            f"| {name} | {size:.0f} | {r['dlogp']:.4f} | {r['nll']:.4f} ({r['nll_ref']:.4f}) | "
            f"{100 * (r['nll'] / r['nll_ref'] - 1):+.2f}% | {r['top1']:.3f} | {greedy} |"
        )


if __name__ == "__main__":
    main()
