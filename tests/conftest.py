"""Shared fixtures: tiny models exported once per session through the real exporter path (plain helpers:
``helpers.py``)."""

from __future__ import annotations

import os
import tempfile

import pytest

# device cost profiles are cached per user; tests keep theirs in a throwaway directory
os.environ["EDGE_SPEC_CACHE"] = tempfile.mkdtemp(prefix="edge-spec-test-cache-")

from tests import tiny_models
from tests.helpers import export_tiny


@pytest.fixture(scope="session")
def tiny_pair():
    tokenizer = tiny_models.make_tokenizer()
    target = tiny_models.make_qwen2(seed=0)
    draft = tiny_models.perturbed_copy(target, seed=1, noise=0.15)
    return tokenizer, target, draft


@pytest.fixture(scope="session")
def fp32_bundle(tmp_path_factory, tiny_pair):
    return export_tiny(tmp_path_factory.mktemp("b") / "fp32", tiny_pair, quant="fp32")


@pytest.fixture(scope="session")
def int4_bundle(tmp_path_factory, tiny_pair):
    """int4 bundle with drafter heads: full, VocabTrim at 160 and 64 rows (of 384), SpecVocab (rank 16,
    48 candidates) over all 384 tokens or the 160 most frequent ones, alone and united with a
    32-row VocabTrim set."""
    return export_tiny(
        tmp_path_factory.mktemp("b") / "int4",
        tiny_pair,
        quant="int4",
        draft_vocab="trim,specvocab,trim+specvocab",
        keep=(160, 64),
        calibration_tokens=24,
        rank=(16,),
        candidates=(48,),
        union_keep=32,
        scorer_vocab=(0, 160),
    )


@pytest.fixture(scope="session")
def target_path(int4_bundle):
    """The int4 bundle's target graph."""
    from edge_spec.manifest import read_manifest

    return int4_bundle / read_manifest(int4_bundle)["target"]["onnx"]
