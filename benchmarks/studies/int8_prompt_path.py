"""What reading a long prompt through int8 matmuls (MLAS's QGEMM) would buy, and what it would cost in fidelity.

Reading a prompt is compute-bound. ``MatMulNBits`` (the decode path's int4 kernel) reads 512 prompt rows about
as fast as a float32 ``MatMul`` does, while ONNX Runtime's int8 GEMM has an AMX kernel on CPUs that have one
(``prefill_kernels.py``: 12x on one MLP-shaped node). This study derives, from a bundle's target graph, a
prompt-reading graph whose layer matmuls are int8 (weights per output row, from the target's own blocks with
their correction folded back in), and measures on the long bench prompts, against the target graph itself:

* the time to read each prompt (512-row passes, as the runtime reads a prompt);
* teacher-forced fidelity over every prompt position: top-1 agreement with the decode path, mean KL from it,
  and the NLL of the prompt's own next tokens.

The int8 path quantizes activations at run time, and how it does so decides its fidelity:

* ``per-tensor``: ``DynamicQuantizeMatMul`` everywhere (one scale per 512-row pass);
* ``per-row-down``: the down projection's input quantized per row, with its :data:`OUTLIERS` largest channels
  (by their peak on calibration prompts, which are not the measured ones) multiplied in float32 beside it;
  the other projections per tensor. The down projection's input carries the model's massive activations:
  one scale per pass there loses the rest of the pass;
* ``per-row+outliers``: every projection's input quantized per row, plus the down projection's outlier channels;
* ``per-row``: every projection's input quantized per row, as ``export --prompt-reader`` builds it
  (``edge_spec.export.graph.prompt_reader``).

A prompt graph is another reading of the model: a prompt's keys and values would come from other kernels
than a decoded token's, so an answer would depend on how its context was read (whole, or decoded earlier in
a session), not on its tokens alone. Speculative decoding stays lossless against a target that reads
prompts this way; the target is not the one the decode path alone defines. The study says how far apart
the two are.

    python benchmarks/studies/int8_prompt_path.py --bundle BUNDLE --threads 2 [--prompts 3] [--calibration 3]

It holds the target's weights in memory while deriving (about 6 GB) and writes the derived graphs to a
temporary folder (about 2 GB each).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edge_spec.bench.long_prompts import long_prompts
from edge_spec.export.graph.prompt_reader import SHARED_CONSTANTS, effective_weight, int8_matmul_nodes, int8_rows
from edge_spec.runtime.model.decoder import PREFILL_CHUNK, Decoder
from edge_spec.runtime.model.native_attention import native_library, prompt_path
from edge_spec.runtime.text import TextTokenizer

VARIANTS = ("per-tensor", "per-row-down", "per-row+outliers", "per-row")
WITH_OUTLIERS = ("per-row-down", "per-row+outliers")
OUTLIERS = 16  # down-projection input channels kept in float32
MS = "com.microsoft"


# -- the prompt graph --------------------------------------------------------------------------------------


class PromptGraph:
    """Nodes and constants replacing one matmul at a time."""

    def __init__(self) -> None:
        self.constants: list[onnx.TensorProto] = []
        for name, value in SHARED_CONSTANTS.items():
            self.const(name, value)

    def const(self, name: str, value: np.ndarray) -> str:
        self.constants.append(numpy_helper.from_array(value, name))
        return name

    def per_tensor(self, name: str, x: str, weight: np.ndarray, y: str) -> list[onnx.NodeProto]:
        codes, scales = int8_rows(weight)
        inputs = [x, self.const(name + ".int8", codes), self.const(name + ".int8_scales", scales)]
        return [helper.make_node("DynamicQuantizeMatMul", inputs, [y], domain=MS)]

    def per_row(self, name: str, x: str, weight: np.ndarray, y: str) -> list[onnx.NodeProto]:
        """As the exported prompt graph does it: ``x`` rounded to uint8 at one scale per row."""
        codes, scales = int8_rows(weight)
        w, s = self.const(name + ".int8", codes), self.const(name + ".int8_scales", scales)
        return int8_matmul_nodes(name, x, weight.shape[1], w, s, y)

    def with_outliers(self, name, x, weight, channels, y, quantized) -> list[onnx.NodeProto]:
        """``channels`` of ``x`` multiplied in float32, the rest through ``quantized``."""
        mask = np.ones(weight.shape[1], np.float32)
        mask[channels] = 0
        make = helper.make_node
        nodes = [make("Mul", [x, self.const(name + ".inlier_mask", mask)], [name + "/inliers"])]
        nodes += quantized(name, name + "/inliers", weight * mask, name + "/int8_out")
        nodes += [
            make(
                "Gather",
                [x, self.const(name + ".outlier_channels", channels.astype(np.int64))],
                [name + "/outliers"],
                axis=-1,
            ),
            make(
                "MatMul",
                [name + "/outliers", self.const(name + ".outlier_rows", weight[:, channels].T.copy())],
                [name + "/outlier_out"],
            ),
            make("Add", [name + "/int8_out", name + "/outlier_out"], [y]),
        ]
        return nodes


def derive(model: onnx.ModelProto, variant: str, glu_peaks: np.ndarray) -> onnx.ModelProto:
    """``model`` (a target graph, weights in memory) with its layers' matmuls on int8 kernels."""
    graph = model.graph
    initializer = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    prompt = PromptGraph()
    replaced: dict[str, list[onnx.NodeProto]] = {}
    dropped: set[str] = set()
    for node in graph.node:
        if node.op_type != "MatMulNBits" or not node.name.startswith("layers."):
            continue  # the LM head reads one row a prompt
        weight, x, feeders = effective_weight(node, producers, initializer)
        dropped.update(f.name for f in feeders)
        name, y = node.output[0], node.output[0]
        has_bias = len(node.input) > 5 and node.input[5] != ""
        if has_bias:
            y = name + "/no_bias"
        down = ".down/" in name
        per_row = variant.startswith("per-row") and (down or variant != "per-row-down")
        quantized = prompt.per_row if per_row else prompt.per_tensor
        if down and variant in WITH_OUTLIERS:
            layer = int(name.split(".")[1])
            channels = np.sort(np.argsort(-glu_peaks[layer])[:OUTLIERS])
            nodes = prompt.with_outliers(name, x, weight, channels, y, quantized)
        else:
            nodes = quantized(name, x, weight, y)
        if has_bias:
            nodes.append(helper.make_node("Add", [y, node.input[5]], [node.output[0]]))
        replaced[node.name] = nodes
    nodes = []
    for node in graph.node:
        if node.name not in dropped:
            nodes += replaced.get(node.name, [node])
    derived = onnx.ModelProto()
    derived.CopyFrom(model)
    del derived.graph.node[:]
    derived.graph.node.extend(nodes)
    used = {i for n in nodes for i in n.input}
    kept = [t for t in model.graph.initializer if t.name in used]
    del derived.graph.initializer[:]
    derived.graph.initializer.extend(kept + [t for t in prompt.constants if t.name in used])
    return derived


# -- measuring ----------------------------------------------------------------------------------------------


def glu_peaks(model: onnx.ModelProto, folder: Path, prompts: list[list[int]], threads: int) -> np.ndarray:
    """Each layer's down-projection input channels' largest magnitude over ``prompts`` (decode path)."""
    layers = sum(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for i in range(layers):
        probe.graph.output.append(helper.make_tensor_value_info(f"layers.{i}/glu", TensorProto.FLOAT, None))
    path = save(probe, folder / "probe")
    decoder = Decoder(path, threads=threads)
    peaks = None
    for ids in prompts:
        decoder.rewind(0)
        for start in range(0, len(ids), PREFILL_CHUNK):
            out = decoder.forward(ids[start : start + PREFILL_CHUNK], num_logits=PREFILL_CHUNK, prefill=True)
            rows = np.stack([np.abs(out[f"layers.{i}/glu"]).max(0) for i in range(layers)])
            peaks = rows if peaks is None else np.maximum(peaks, rows)
    return peaks


def save(model: onnx.ModelProto, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    return path


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def seconds_to_read(decoder: Decoder, ids: list[int]) -> float:
    """Seconds to read ``ids`` in prompt passes, after a warm-up pass."""
    decoder.rewind(0)
    decoder.forward(ids[:PREFILL_CHUNK], prefill=True)
    decoder.rewind(0)
    start_time = time.perf_counter()
    for start in range(0, len(ids), PREFILL_CHUNK):
        decoder.forward(ids[start : start + PREFILL_CHUNK], prefill=True)
    return time.perf_counter() - start_time


def fidelity(reference: Decoder, other: Decoder, ids: list[int]) -> dict:
    """Teacher-forced over every position of ``ids`` but the last, a pass at a time (each pass's
    log-probabilities are a 512 x vocabulary array)."""
    top1 = kl = nll = nll_reference = 0.0
    for decoder in (reference, other):
        decoder.rewind(0)
    for start in range(0, len(ids) - 1, PREFILL_CHUNK):
        chunk = ids[start : start + PREFILL_CHUNK]
        following = np.array(ids[start + 1 : start + 1 + len(chunk)])
        rows = np.arange(len(following))
        ref, got = (
            log_softmax(d.forward(chunk, num_logits=len(chunk), prefill=True)["logits"])[rows]
            for d in (reference, other)
        )
        top1 += float((ref.argmax(-1) == got.argmax(-1)).sum())
        kl += float((np.exp(ref) * (ref - got)).sum())
        nll += float(-got[rows, following].sum())
        nll_reference += float(-ref[rows, following].sum())
    n = len(ids) - 1
    return {"top1": top1 / n, "kl": kl / n, "nll": nll / n, "nll_reference": nll_reference / n}


def runtime_readers(target: Path, paths: dict[str, Path], threads: int, takes_turns: bool = False) -> list:
    """The ``per-row`` graph as the runtime loads a prompt reader: beside the target, its attention on the native
    op's prompt path where this CPU has one (AMX's bfloat16 tiles), else ORT's."""
    if "per-row" not in paths:
        return []
    library = native_library("cpu")
    path = prompt_path(library) if library is not None else ""
    name = f"per-row, {path or 'ORT'} attention, runtime"

    def load() -> Decoder:
        return Decoder(target, threads=threads, takes_turns=takes_turns, prompt_graph=paths["per-row"])

    return [(name, load)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=3, help="long bench prompts measured (the first ones)")
    parser.add_argument("--calibration", type=int, default=3, help="long bench prompts after those, for the outliers")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: choose among {', '.join(VARIANTS)}")
    tokenizer = TextTokenizer(args.bundle)
    texts = [p["prompt"] for p in long_prompts()]
    if args.prompts + args.calibration > len(texts):
        raise SystemExit(f"there are {len(texts)} long prompts: --prompts plus --calibration must not exceed that")
    ids = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    measured, calibration = ids[: args.prompts], ids[args.prompts : args.prompts + args.calibration]
    target = args.bundle / "target" / "model.onnx"
    model = onnx.load(str(target))
    with tempfile.TemporaryDirectory(prefix="int8-prompt-") as tmp:
        needs_peaks = set(variants) & set(WITH_OUTLIERS)
        peaks = glu_peaks(model, Path(tmp), calibration, args.threads) if needs_peaks else None
        paths = {v: save(derive(model, v, peaks), Path(tmp) / v) for v in variants}
        del model
        print(f"{args.bundle.name}: {args.threads} threads, long prompts of {[len(i) for i in measured]} tokens")
        print("time to read each prompt (512-row passes), one reader loaded at a time:")
        readers = [
            ("decode path, native attention", lambda: Decoder(target, threads=args.threads)),
            ("decode path, ORT attention", lambda: Decoder(target, threads=args.threads, native_attention=False)),
        ]
        readers += [(v, lambda p=p: Decoder(p, threads=args.threads, native_attention=False)) for v, p in paths.items()]
        readers += runtime_readers(target, paths, args.threads)
        for name, load in readers:
            decoder = load()
            seconds = [seconds_to_read(decoder, prompt) for prompt in measured]
            del decoder
            rates = ", ".join(f"{len(p) / s:.1f}" for p, s in zip(measured, seconds))
            print(f"  {name:32s} {' / '.join(f'{s:.2f}' for s in seconds)} s  ({rates} tok/s)", flush=True)
        print("teacher-forced over the prompts' positions, against the decode path:")
        reference = Decoder(target, threads=args.threads, takes_turns=True)
        others = [
            (v, lambda p=p: Decoder(p, threads=args.threads, native_attention=False, takes_turns=True))
            for v, p in paths.items()
        ]
        for variant, load in others + runtime_readers(target, paths, args.threads, takes_turns=True):
            other = load()
            results = [fidelity(reference, other, prompt) for prompt in measured]
            del other
            mean = {k: float(np.mean([r[k] for r in results])) for k in results[0]}
            print(
                f"  {variant:32s} top-1 agreement {mean['top1']:.3f}  mean KL {mean['kl']:.4f}  NLL {mean['nll']:.4f}"
                f" (decode path {mean['nll_reference']:.4f}, {mean['nll'] / mean['nll_reference'] - 1:+.2%})",
                flush=True,
            )


if __name__ == "__main__":
    main()
