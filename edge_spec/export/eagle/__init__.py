"""The EAGLE-3 head: its PyTorch model and graphs, attaching a trained one and its LM heads (training one
on the target's features is :mod:`edge_spec.train`'s)."""
