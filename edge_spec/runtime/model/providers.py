"""Execution-provider selection: map a short user-facing name to an ORT provider, or fail clearly."""

from __future__ import annotations

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
