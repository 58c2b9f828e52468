"""The ONNX graphs an export writes: a decoder graph built from weights (``builder``) with its rotary
tables (``rope``), block quantization (``quantize``, on every core: ``parallel``) and the throw-away query
row of exact one-token passes (``attention_pad``); ``weights`` is the architecture-neutral hand-off from
the loaders (:mod:`edge_spec.export.sources.resolve.resolve`) to the builder."""
