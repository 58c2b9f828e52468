"""Training an EAGLE-3 head (``edge-spec train-head``): the target's features collected as training data
(``features``), the head trained on them on CPU (``trainer``), a built head read back into torch to
train further (``saved``), and the settings with their defaults (``settings``, light: the CLI's help
reads it).

The head itself (its torch module, SpecForge checkpoints, ONNX graphs) and attaching it to a bundle are
the exporter's (``edge_spec.export.eagle``): a trained head reaches a bundle the way any other head does.
"""
