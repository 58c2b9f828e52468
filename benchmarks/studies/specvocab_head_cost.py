"""Drafter head cost per draft step: full head, VocabTrim heads, SpecVocab heads (as the runtime runs
them: ORT scorer, numpy top-k, numpy gather + dot) and SpecVocab with the gather + dot inside ONNX.

Why: SpecVocab only pays if scoring 150k tokens at rank R, picking the top k and computing k exact
logits costs much less than the full head.  This measures each piece on real drafter hidden states
(the drafter body run over a calibration answer), one head at a time, in one process.

    python benchmarks/studies/specvocab_head_cost.py [BUNDLE] --threads 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from edge_spec.export.graph.builder import Graph, make_model, save_model
from edge_spec.paths import DEFAULT_BUNDLE
from edge_spec.runtime.engine import Engine


def median_ms(fn, states: np.ndarray, repeats: int) -> float:
    for h in states[:5]:
        fn(h)
    times = []
    for _ in range(repeats):
        for h in states:
            started = time.perf_counter()
            fn(h)
            times.append(time.perf_counter() - started)
    return 1e3 * float(np.median(times))


def onnx_gather_head(rows: np.ndarray, scales: np.ndarray, candidates: int, path: Path, threads: int):
    """candidate ids [k] + hidden [H] -> exact logits [k]: Gather(int8 rows) -> Cast -> MatMul -> Mul(scales)."""
    g = Graph()
    gathered = g.node("Gather", [g.const("rows", rows), "ids"], ["g"], axis=0)[0]
    as_float = g.node("Cast", [gathered], ["gf"], to=TensorProto.FLOAT)[0]
    dots = g.node("MatMul", [as_float, "hidden"], ["dots"])[0]
    row_scales = g.node("Gather", [g.const("scales", scales), "ids"], ["s"], axis=0)[0]
    g.node("Mul", [dots, row_scales], ["logits"])
    graph = helper.make_graph(
        g.nodes,
        "gather_head",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [candidates]),
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [rows.shape[1]]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [candidates])],
        g.initializers,
    )
    save_model(make_model(graph), path)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", nargs="?", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engine = Engine.from_bundle(args.bundle, threads=args.threads, mode="ar")
    prompt = engine.prompt_ids([{"role": "user", "content": "Write a Python function that merges two sorted lists."}])
    answer = engine.complete(
        [{"role": "user", "content": "Write a Python function that merges two sorted lists."}], max_new_tokens=48
    ).token_ids
    body = engine.bundle.drafter.body
    body.reset()
    states = body.forward(prompt + answer, len(answer))["hidden_states"]
    print(f"{len(states)} drafter hidden states; {args.threads} threads; median ms per draft step")
    print(f"{'head':34s} {'rows':>6s} {'total':>7s}  pieces")
    full_ms = None
    for name, entry in engine.bundle.manifest["draft"]["heads"].items():
        engine.use_draft_head(name)
        head = engine.bundle.drafter.head
        total = median_ms(head, states, args.repeats)
        full_ms = total if name == "full" else full_ms
        pieces = ""
        if entry.get("kind") == "specvocab":
            scorer = median_ms(lambda h: head.session.run(None, {"hidden_states": h[None, None]}), states, args.repeats)
            scores = [head.session.run(None, {"hidden_states": h[None, None]})[0][0, 0] for h in states]
            it = iter(scores * (args.repeats + 1))
            select = median_ms(lambda h: head._select(next(it).copy()), states, args.repeats)
            ids = head._select(scores[0].copy())
            dot = median_ms(lambda h: (head.rows[ids].astype(np.float32) @ h) * head.scales[ids], states, args.repeats)
            session = onnx_gather_head(
                head.rows, head.scales, len(ids), Path("/tmp/edge_spec_gather_head.onnx"), args.threads
            )
            in_onnx = median_ms(lambda h: session.run(None, {"ids": ids, "hidden": h}), states, args.repeats)
            pieces = (
                f"scorer {scorer:.3f} + select {select:.3f} + numpy gather/dot {dot:.3f} "
                f"(same gather/dot in ONNX: {in_onnx:.3f})"
            )
        share = f" = {total / full_ms:.0%} of full" if full_ms and name != "full" else ""
        print(f"{name:34s} {entry['size']:6d} {total:7.3f}  {pieces}{share}")


if __name__ == "__main__":
    main()
