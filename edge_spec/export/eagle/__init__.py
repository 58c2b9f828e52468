"""The EAGLE-3 head: its PyTorch model and graphs, attaching a trained one, its LM heads, and training one
on the target's features."""
