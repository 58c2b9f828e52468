"""Shared fixtures: tiny models exported once per session through the real exporter path, and engines on
the int4 bundle shared within a test module (plain helpers: ``helpers.py``).  A module that needs another
``engine`` (another bundle, a fresh one per test) defines its own, which takes the place of this one."""

from __future__ import annotations

import os
import tempfile

import pytest

# device cost profiles are cached per user; tests keep theirs in a throwaway directory
os.environ["EDGE_SPEC_CACHE"] = tempfile.mkdtemp(prefix="edge-spec-test-cache-")

from tests import tiny_models
from tests.helpers import export_tiny


@pytest.fixture(scope="session")
def native_library():
    """The native ops' library (``edge_spec.native``) built from the repo: skipped without a C++ compiler,
    failed when it does not build."""
    from edge_spec.native import build

    if build.compiler() is None:
        pytest.skip("no C++ compiler (g++ or clang++): the native ops cannot be built here")
    try:
        return build.build()
    except build.BuildError as exc:
        pytest.fail(f"the native ops do not build: {exc}")


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


@pytest.fixture(scope="module")
def engine(int4_bundle):
    """The int4 tiny bundle's engine in its default mode (spec), one thread, closed at the module's end."""
    from edge_spec.runtime.engine import Engine

    engine = Engine.from_bundle(int4_bundle, mode="spec", threads=1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ar_engine(int4_bundle):
    """The int4 tiny bundle's target-only engine (mode ar), one thread, closed at the module's end."""
    from edge_spec.runtime.engine import Engine

    engine = Engine.from_bundle(int4_bundle, mode="ar", threads=1)
    yield engine
    engine.close()
