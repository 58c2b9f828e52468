"""edge-spec: speculative decoding for local LLMs on ONNX Runtime."""

__version__ = "0.1.0"
