"""The native attention op's prompt path (attribute ``bf16_products``): what a prompt graph's passes run on
CPUs with AMX.

It rounds queries, keys, values and the softmax weights to bfloat16, so it is held to ORT's float32 op
within bfloat16's error, and to no more: a path that skipped a key, saw a later one or dropped the bias
lands far outside that error.  The cache it writes is float32 and exact.  Where the CPU has no AMX the op
keeps its float32 path, and the runtime keeps ORT's op for prompt graphs.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edge_spec.native import build
from edge_spec.runtime.model.native_attention import NATIVE_DOMAIN, prompt_path, use_native_attention
from tests.test_native_attention import gqa_model, session

HEADS, KV_HEADS = 12, 2  # six query heads to a key/value head, as the default target has (its drafter: seven)
CAPACITY = 1024
BFLOAT16_ERROR = 2e-2  # relative L2 error of an attention output whose products round to bfloat16


@pytest.fixture(scope="module")
def library():
    if build.compiler() is None:
        pytest.skip("no C++ compiler (g++ or clang++): the native attention op cannot be built here")
    path = build.build()
    if prompt_path(path) != "amx":
        pytest.skip("this CPU has no AMX: prompt graphs keep ORT's attention op")
    return path


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    monkeypatch.setenv("EDGE_SPEC_NATIVE_ATTENTION", "1")


def attention_model(domain: str, head: int, bf16_products: bool, heads: int = HEADS) -> bytes:
    extra = {"bf16_products": 1} if bf16_products else {}
    return gqa_model(domain, tree=True, shape=(heads, KV_HEADS, head, CAPACITY, CAPACITY), **extra)


def feeds(head: int, context: int, rows: int, seed: int, heads: int = HEADS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    angles = np.arange(CAPACITY)[:, None] * (1e-2 * np.arange(1, head // 2 + 1))[None, :]
    return {
        "qkv": rng.standard_normal((1, rows, (heads + 2 * KV_HEADS) * head)).astype(np.float32),
        "past_k": rng.standard_normal((1, KV_HEADS, CAPACITY, head)).astype(np.float32),
        "past_v": rng.standard_normal((1, KV_HEADS, CAPACITY, head)).astype(np.float32),
        "seqlens_k": np.array([context + rows - 1], np.int32),
        "total": np.array(context + rows, np.int32),
        "cos": np.cos(angles).astype(np.float32),
        "sin": np.sin(angles).astype(np.float32),
        "position_ids": np.arange(context, context + rows, dtype=np.int64)[None],
        "attention_bias": np.zeros((1, 1, rows, context + rows), np.float32),
    }


def outputs(sess: ort.InferenceSession, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, inputs)))


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


@pytest.mark.parametrize(("heads", "head"), [(12, 128), (12, 64), (14, 64)])  # the default target's, the drafter's
@pytest.mark.parametrize(("context", "rows"), [(0, 1), (0, 40), (37, 3), (300, 257), (600, 100)])
def test_the_prompt_path_computes_orts_attention_to_bfloat16(library, heads, head, context, rows):
    inputs = feeds(head, context, rows, seed=context * 1000 + rows, heads=heads)
    ours = outputs(session(attention_model(NATIVE_DOMAIN, head, True, heads), library), inputs)
    theirs = outputs(session(attention_model("com.microsoft", head, False, heads)), inputs)
    error = relative_error(ours["out"], theirs["out"])
    assert 0 < error < BFLOAT16_ERROR  # it rounds, and no more than bfloat16 does
    for present in ("present_k", "present_v"):  # the cache stays float32: exactly what ORT's op writes
        np.testing.assert_allclose(
            ours[present][:, :, : context + rows], theirs[present][:, :, : context + rows], atol=1e-6
        )


def test_the_prompt_path_takes_the_attention_bias(library):
    """A bias that hides the first half of the keys gives ORT's answer with that bias, far from the answer
    without it: the comparison above can fail."""
    inputs = feeds(128, 200, 64, seed=3)
    inputs["attention_bias"][..., :100] = -np.inf
    ours = outputs(session(attention_model(NATIVE_DOMAIN, 128, True), library), inputs)["out"]
    theirs = outputs(session(attention_model("com.microsoft", 128, False)), inputs)["out"]
    unbiased = {**inputs, "attention_bias": np.zeros_like(inputs["attention_bias"])}
    without = outputs(session(attention_model("com.microsoft", 128, False)), unbiased)["out"]
    assert relative_error(ours, theirs) < BFLOAT16_ERROR
    assert relative_error(ours, without) > 10 * BFLOAT16_ERROR


def test_a_row_sees_its_causal_window_and_nothing_after_it(library):
    """Changing the last row's key and value leaves every earlier row's output as it was."""
    inputs = feeds(64, 90, 48, seed=4)
    sess = session(attention_model(NATIVE_DOMAIN, 64, True), library)
    before = outputs(sess, inputs)["out"]
    width = HEADS * 64
    changed = {**inputs, "qkv": inputs["qkv"].copy()}
    changed["qkv"][0, -1, width:] += 5.0  # the last row's key and value
    after = outputs(sess, changed)["out"]
    np.testing.assert_array_equal(after[0, :-1], before[0, :-1])
    assert not np.array_equal(after[0, -1], before[0, -1])


def test_a_prompt_graph_asks_for_the_prompt_path():
    model = onnx.load_from_string(attention_model("com.microsoft", 64, False))
    assert use_native_attention(model, bf16_products=True) == 1
    node = model.graph.node[0]
    assert node.domain == NATIVE_DOMAIN
    assert {a.name: a.i for a in node.attribute}["bf16_products"] == 1
    decode = onnx.load_from_string(attention_model("com.microsoft", 64, False))
    use_native_attention(decode)
    assert "bf16_products" not in {a.name for a in decode.graph.node[0].attribute}


def test_the_switch_keeps_orts_op_for_prompt_graphs(library, monkeypatch):
    """``EDGE_SPEC_NATIVE_AMX=0`` turns the prompt path off: the library then reports none."""
    import subprocess
    import sys

    code = (
        "import sys; from edge_spec.runtime.model.native_attention import prompt_path; print(prompt_path(sys.argv[1]))"
    )
    for switch, want in (("1", "amx"), ("0", "")):
        env = {**__import__("os").environ, "EDGE_SPEC_NATIVE_AMX": switch}
        got = subprocess.run([sys.executable, "-c", code, str(library)], env=env, capture_output=True, text=True)
        assert got.stdout.strip() == want, got.stderr
