"""Execution-provider selection: map a short user-facing name to an ORT provider, or fail clearly."""

from __future__ import annotations

import contextlib
import io

import onnxruntime as ort

from edge_spec.errors import EdgeSpecError

PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "directml": "DmlExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
}

# Rows from which every pass of an execution provider takes the same kernels, so that each row's result
# does not depend on how many rows share the pass (see ``decoder``, "batch-invariant numerics"): the CPU
# EP's kernels have a one-row path; WebGPU's int4 MatMulNBits has another path below four rows.
EXACT_MIN_ROWS = {"webgpu": 4}


def exact_min_rows(provider: str) -> int:
    """How many rows a batch-invariant pass on ``provider`` needs (shorter passes are padded)."""
    return EXACT_MIN_ROWS.get(provider.lower(), 2)


def resolve_provider(name: str) -> list[str]:
    """Providers list for ``InferenceSession``: the requested one, with CPU as fallback for unsupported ops."""
    key = name.lower()
    if key not in PROVIDER_NAMES:
        raise EdgeSpecError(f"unknown provider {name!r}; choose one of: {', '.join(PROVIDER_NAMES)}")
    full = PROVIDER_NAMES[key]
    available = ort.get_available_providers()
    if full not in available:
        have = ", ".join(k for k, v in PROVIDER_NAMES.items() if v in available)
        raise EdgeSpecError(
            f"execution provider {key!r} ({full}) is not installed in this onnxruntime build; available: {have}"
        )
    return [full] if full == "CPUExecutionProvider" else [full, "CPUExecutionProvider"]


def open_session(
    model, opts: ort.SessionOptions, provider: str, provider_options: dict[str, str] | None = None
) -> ort.InferenceSession:
    """An ``InferenceSession`` on ``provider`` (CPU as fallback for single unsupported ops), or a one-line
    error.  ORT's Python API silently falls back to the CPU EP when an EP cannot start (no GPU adapter,
    no driver) and prints why on stdout; here that is caught and named instead of running on the CPU."""
    providers = resolve_provider(provider)
    options = [provider_options or {}] + [{}] * (len(providers) - 1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        session = ort.InferenceSession(model, opts, providers=providers, provider_options=options)
    if session.get_providers()[0] != providers[0]:
        raise EdgeSpecError(
            f"execution provider {provider.lower()!r} could not start: {_why(printed.getvalue())}; "
            f"see edge-spec info --providers"
        )
    return session


def _why(printed: str) -> str:
    """The first line of ORT's 'EP Error' message, without its source location."""
    for line in printed.splitlines():
        if line.startswith("EP Error"):
            text = line.removeprefix("EP Error").strip()
            return (text.split(" was false. ")[-1].split(" when using ")[0] or text)[:200]
    return "no reason given"


def provider_report(options: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(name, one line) per execution provider edge-spec knows: whether this onnxruntime build has it and,
    where it has, whether a session on it runs (that is where a missing GPU adapter or driver shows)."""
    available = ort.get_available_providers()
    report = []
    for key, full in PROVIDER_NAMES.items():
        if full not in available:
            report.append((key, f"not in this onnxruntime build ({ort.__version__}){_INSTALL_HINT.get(key, '')}"))
            continue
        why = _run_one_node(full, options if key != "cpu" else None)
        report.append((key, f"usable ({full}, onnxruntime {ort.__version__})" if why is None else f"unusable: {why}"))
    return report


_INSTALL_HINT = {
    "webgpu": "; pip uninstall -y onnxruntime && pip install onnxruntime-webgpu",
    "cuda": "; pip uninstall -y onnxruntime && pip install onnxruntime-gpu",
    "directml": "; pip uninstall -y onnxruntime && pip install onnxruntime-directml (Windows)",
    "openvino": "; pip uninstall -y onnxruntime && pip install onnxruntime-openvino",
    "qnn": "; pip uninstall -y onnxruntime && pip install onnxruntime-qnn (Windows on Snapdragon)",
}


def _run_one_node(full: str, options: dict[str, str] | None) -> str | None:
    """None when a one-node graph runs on ``full`` alone (no CPU fallback), else why not, in one line."""
    import numpy as np
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # the probe's failure is reported in one line below, not logged
    key = next(k for k, v in PROVIDER_NAMES.items() if v == full)
    try:
        session = open_session(model.SerializeToString(), opts, key, options)
        x = np.arange(4, dtype=np.float32)
        if not np.array_equal(session.run(None, {"x": x})[0], 2 * x):
            return "a test graph computed a wrong result"
    except EdgeSpecError as exc:
        return str(exc).split(": ", 1)[-1].split("; see edge-spec")[0]
    except Exception as exc:  # ORT raises bare RuntimeError / EPFail when the device or driver is missing
        text = " ".join(str(exc).split())
        return text[:200] or type(exc).__name__
    return None
