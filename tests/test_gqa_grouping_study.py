"""The attention study's drop-in graph must compute what ``GroupQueryAttention`` computes.

``benchmarks/studies/gqa_grouping.py`` times a graph that reads each KV head once against the fused op, and
docs/measurements.md reports what it would save: a timing of different maths would be no answer.  Its
query heads are regrouped by KV head and back, and its mask must give new token r the context plus new
tokens 0..r, as the fused op's causal mask does.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

STUDY = Path(__file__).resolve().parents[1] / "benchmarks" / "studies" / "gqa_grouping.py"


@pytest.fixture
def study(monkeypatch):
    spec = importlib.util.spec_from_file_location("gqa_grouping", STUDY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LAYERS", 2)
    monkeypatch.setattr(module, "CAPACITY", 64)
    return module


def outputs(study, model: bytes, feeds: dict) -> dict[str, np.ndarray]:
    session = study.session(model, 1)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


CONTEXT = 37


def random_feeds(study, rows: int) -> dict[str, np.ndarray]:
    """``rows`` new tokens after ``CONTEXT`` cached ones; every cache slot random, so stale values past
    the context would leak into a wrong answer."""
    rng = np.random.default_rng(rows)
    feeds = {
        "q": rng.standard_normal((1, rows, study.HEADS * study.HEAD_DIM)).astype(np.float32),
        "k": rng.standard_normal((1, rows, study.KV_HEADS * study.HEAD_DIM)).astype(np.float32),
        "v": rng.standard_normal((1, rows, study.KV_HEADS * study.HEAD_DIM)).astype(np.float32),
        "seqlens_k": np.array([CONTEXT + rows - 1], np.int32),
        "total": np.array(CONTEXT + rows, np.int32),
    }
    cache = (1, study.KV_HEADS, study.CAPACITY, study.HEAD_DIM)
    for i in range(study.LAYERS):
        for kind in ("k", "v"):
            feeds[f"past_{kind}{i}"] = rng.standard_normal(cache).astype(np.float32)
    return feeds


@pytest.mark.parametrize("rows", [1, 5])
def test_the_drop_in_graph_equals_the_fused_op(study, rows):
    context, capacity = CONTEXT, study.CAPACITY
    feeds = random_feeds(study, rows)
    fused = outputs(study, study.gqa_model(np.float32), feeds)
    mask = study.dropin_mask(context, rows, capacity)
    dropin = outputs(study, study.dropin_model(capacity), {**feeds, "mask": mask})
    for i in range(study.LAYERS):
        np.testing.assert_array_equal(dropin[f"present_k{i}"], fused[f"present_k{i}"])
        np.testing.assert_array_equal(dropin[f"present_v{i}"], fused[f"present_v{i}"])
        np.testing.assert_allclose(dropin[f"out{i}"], fused[f"out{i}"], rtol=0, atol=1e-5)
    # the check can fail: a mask one position short of the fused op's changes the answer
    short = mask.copy()
    short[0, 0, :, context] = -np.inf
    wrong = outputs(study, study.dropin_model(capacity), {**feeds, "mask": short})
    assert np.abs(wrong["out0"] - fused["out0"]).max() > 1e-3


@pytest.mark.parametrize("rows", [1, 5])
def test_the_native_op_graph_equals_the_fused_op(study, rows):
    """The study's native-op graph (``edge_spec/native``) gives what the fused op gives, cache writes included."""
    from edge_spec.native import build

    if build.compiler() is None:
        pytest.skip("no C++ compiler (g++ or clang++): the native attention op cannot be built here")
    library = str(build.build())
    feeds = random_feeds(study, rows)
    fused = outputs(study, study.gqa_model(np.float32), feeds)
    native_session = study.session(study.gqa_model(np.float32, study.NATIVE_DOMAIN), 1, library)
    names = [o.name for o in native_session.get_outputs()]
    native = dict(zip(names, native_session.run(None, feeds)))
    for i in range(study.LAYERS):
        np.testing.assert_array_equal(native[f"present_v{i}"], fused[f"present_v{i}"])
        np.testing.assert_allclose(native[f"out{i}"], fused[f"out{i}"], rtol=1e-4, atol=2e-6)
