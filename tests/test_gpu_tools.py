"""The two tools that take the pair to a GPU machine the weights cannot reach: a bundle of the pair's shapes
with random weights (``edge_spec.bench.shaped``, behind ``shaped_bundle.py``), and the row classes an
execution provider is measured with (``edge_spec.bench.row_classes``, behind ``ep_exactness.py``)."""

from __future__ import annotations

import numpy as np

from edge_spec.bench import shaped
from edge_spec.bench.row_classes import logits_by_pass_size, row_classes
from edge_spec.manifest import read_manifest
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.model.decoder import Decoder


def test_a_shaped_bundle_has_the_bundles_shapes_and_decodes_exactly(int4_bundle, tmp_path):
    shaped.save_shapes(int4_bundle, tmp_path / "shapes")
    shaped.build(tmp_path / "shapes", tmp_path / "shaped", layers=None, context_length=128, seed=0)
    real, copy = read_manifest(int4_bundle), read_manifest(tmp_path / "shaped")
    for role in ("target", "draft"):
        assert copy[role]["config"] == real[role]["config"]
        assert copy[role]["parameters"] == real[role]["parameters"]
    assert copy["tokenizer"] == real["tokenizer"]  # the same files, byte for byte
    engine = Engine.from_bundle(tmp_path / "shaped", threads=1, mode="spec", draft_head="full")
    reference = engine.complete("def f", max_new_tokens=10, mode="ar", exact=True).token_ids
    assert engine.complete("def f", max_new_tokens=10).token_ids == reference


def test_row_classes_group_pass_sizes_that_agree_bit_for_bit(int4_bundle):
    target = Decoder(int4_bundle / read_manifest(int4_bundle)["target"]["onnx"], threads=1, capacity=64)
    results = logits_by_pass_size(target, (2, 3, 4, 6), tokens=12, context=10, pad_to=2)
    assert row_classes(results) == [[2, 3, 4, 6]]  # the CPU EP: one class from two rows
    results[3] = np.nextafter(results[3], np.inf)  # a size whose kernels round otherwise
    assert row_classes(results) == [[2, 4, 6], [3]]
