"""ONNX Runtime's profiler, read per pass: which kernels ran in which ``model_run``, grouped by node role.

``benchmarks/profile_step.py`` (one decode step by op type and projection) and
``benchmarks/verify_rows_profile.py`` (what each extra verify row adds) both read ORT's profile JSON.
A profile is one flat list of events; a kernel's time only means something once it is attributed to
the pass it ran in, and a pass to the row count it was run with, so that attribution lives here, where
it is tested on a real bundle, and the scripts only print.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from edge_spec.manifest import read_manifest
from edge_spec.runtime.loaded import set_bundle_kernels
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.model.kernel_choice import in_force
from edge_spec.runtime.model.native_attention import QUANTIZED_MATMULS, native_matmul_here


class ProfileMismatch(RuntimeError):
    """The profile holds another number of passes than were run, so no pass can be told its row count."""


def bundle_target(bundle: Path) -> tuple[Path, str]:
    """The bundle's target graph, with the native op's prefetch choices set as a load of the bundle sets them
    (``set_bundle_kernels``), so that passes timed apart from the engine cost what the engine's do; and those
    choices in words ("" where the op does not run the bundle here)."""
    manifest = read_manifest(bundle)
    untimed = set_bundle_kernels(manifest)
    library = native_matmul_here()[0] if "native_kernels" in manifest else None
    words = ""
    if library is not None:
        words = "native op: " + in_force(library)
        if untimed is not None:
            words += " (the vendor's rules: this machine has not timed the bundle yet)"
    return bundle / manifest["target"]["onnx"], words


def profiled_decoder(onnx_path: Path, threads: int, capacity: int = 4096) -> Decoder:
    """A ``Decoder`` whose session writes ORT's profile (into a fresh temporary directory) until
    ``decoder.session.end_profiling()`` returns its path."""
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp(prefix="edge-spec-profile-")) / "target")
    return Decoder(onnx_path, threads=threads, capacity=capacity, session_options=options)


def role_of(node: str) -> str:
    """'layers.3.gate_up/out/MatMulNBits' -> 'gate_up'; 'lm_head/out/MatMulNBits' -> 'lm_head'; a native
    SwiGLU node, 'layers.3/glu/MatMulGGUF', multiplies the gate and up rows: 'gate_up'."""
    if "lm_head" in node:
        return "lm_head"
    if re.match(r"layers\.\d+/glu/", node):
        return "gate_up"
    m = re.match(r"layers\.\d+\.([A-Za-z_]+)", node)
    return m.group(1) if m else node


def matmul_weight_bytes(onnx_path: Path) -> dict[str, int]:
    """Bytes each weight matmul reads per call: MatMulNBits' packed weights and scales (and zero points),
    MatMulGGUF's records."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    size = {
        t.name: int(np.prod(t.dims)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        for t in model.graph.initializer
    }
    return {
        n.name: sum(size.get(x, 0) for x in n.input[1:]) for n in model.graph.node if n.op_type in QUANTIZED_MATMULS
    }


def matmul_bits(onnx_path: Path) -> dict[str, int]:
    """The bit width of each MatMulNBits node (4; 8 where 8-bit GGUF blocks were carried, as Q6_K is)."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    return {
        node.name: next(a.i for a in node.attribute if a.name == "bits")
        for node in model.graph.node
        if node.op_type == "MatMulNBits"
    }


def parse_profile(path: Path) -> list[dict]:
    """One dict per model_run, in order: {'dur': µs, 'kernels': [(node, op, µs), ...]}."""
    events = json.loads(path.read_text())
    runs = sorted(
        (e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"]
    )
    kernels = sorted(
        (e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")),
        key=lambda e: e["ts"],
    )
    out = [{"ts": r["ts"], "end": r["ts"] + r["dur"], "dur": r["dur"], "kernels": []} for r in runs]
    i = 0
    for k in kernels:
        while i < len(out) and k["ts"] > out[i]["end"]:
            i += 1
        if i == len(out):
            break
        if k["ts"] >= out[i]["ts"]:
            node = k["name"][: -len("_kernel_time")]
            out[i]["kernels"].append((node, k.get("args", {}).get("op_name", "?"), k["dur"]))
    return out


@dataclass
class RowProfile:
    """Passes over 1..n rows, interleaved: per row count, each pass's ``model_run`` time (µs) and each
    kernel group's time (ms: the median over its calls of each node, summed over the group's nodes)."""

    walls: dict[int, list[float]]
    groups: dict[int, dict[str, float]]


def profile_rows(
    onnx_path: Path, threads: int, steps: int, rows: int | Sequence[int], prompt_tokens: int = 60
) -> RowProfile:
    """Profile the target ``onnx_path`` over passes of 1..``rows`` tokens (or of each row count in ``rows``)
    after a ``prompt_tokens`` prompt, the row counts taking turns ``steps`` times and each pass rolled back
    (so every pass sees the same context, and a drift of the machine reaches every row count alike).  A
    node's time is the median of its calls, since single calls spike on a shared machine; MatMulNBits nodes
    are grouped by role and bit width (``down/8bit``), the others by op type."""
    row_counts = range(1, rows + 1) if isinstance(rows, int) else sorted(set(rows))
    decoder = profiled_decoder(onnx_path, threads, capacity=max(4096, prompt_tokens + max(row_counts) + 1))
    decoder.reset()
    decoder.forward(list(range(100, 100 + prompt_tokens)))
    order = []
    for step in range(steps):
        for n in row_counts:
            decoder.forward([1000 + step] * n, n)
            decoder.rewind(decoder.length - n)
            order.append(n)
    path = Path(decoder.session.end_profiling())
    try:
        runs = parse_profile(path)[1:]  # the prompt's pass first
    finally:
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()  # the temporary folder profiled_decoder made
        except OSError:
            pass
    if len(runs) != len(order):
        raise ProfileMismatch(f"expected {len(order)} passes in the profile, found {len(runs)}")

    bits = matmul_bits(onnx_path)
    calls: dict[int, dict[tuple[str, str], list[float]]] = {n: defaultdict(list) for n in row_counts}
    walls: dict[int, list[float]] = {n: [] for n in row_counts}
    for n, run in zip(order, runs):
        walls[n].append(run["dur"])
        for node, op, duration in run["kernels"]:
            calls[n][node, op].append(duration)
    groups: dict[int, dict[str, float]] = {n: defaultdict(float) for n in row_counts}
    for n in row_counts:
        for (node, op), durations in calls[n].items():
            group = f"{role_of(node)}/{bits[node]}bit" if op == "MatMulNBits" else op
            groups[n][group] += float(np.median(durations)) / 1e3
    return RowProfile(walls, {n: dict(g) for n, g in groups.items()})
