"""The native layout (``--gguf-layout native``): carried Q4_K and Q6_K matrices as GGUF's own bytes under
``MatMulGGUF``, built into a decoder graph and run by the runtime's ``Decoder``."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

pytest.importorskip("gguf")

from edge_spec.errors import EdgeSpecError  # noqa: E402
from edge_spec.export.bundle.options import ExportOptions, layout_name  # noqa: E402
from edge_spec.export.gguf.blocks import carry_gguf  # noqa: E402
from edge_spec.export.graph.builder import BuildOptions, build_decoder, save_model  # noqa: E402
from edge_spec.native import build  # noqa: E402
from edge_spec.runtime.model.decoder import Decoder  # noqa: E402
from tests import tiny_models  # noqa: E402

HIDDEN = 256  # the native op takes rows of whole 256-weight super-blocks
IDS = [5, 17, 42, 99, 7, 230, 64, 3, 11, 150]
PARTS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(scope="module")
def weights():
    """A tiny Qwen2 whose layer matrices are carried as (random) Q4_K blocks, layer 0's value and down as Q6_K
    (as a Q4_K_M file mixes them)."""
    if build.compiler() is None:
        pytest.skip("no C++ compiler: the native op cannot be built here")
    w = tiny_models.loaded("t", tiny_models.make_qwen2(seed=0, hidden=HIDDEN), tiny_models.make_tokenizer()).weights
    rng = np.random.default_rng(0)
    for i, layer in enumerate(w.layers):
        for part in PARTS:
            n, k = getattr(layer, part).shape
            kind = "Q6_K" if i == 0 and part in ("v", "down") else "Q4_K"
            raw = tiny_models.random_k_quant_blocks(rng, kind, n, k, factor=(1e-4, 5e-4))
            w.carried[f"layers.{i}.{part}"] = carry_gguf(raw, kind, n, k)
    return w


def _path(weights, folder, **options):
    name = "native" if options.get("carry_native") else "lean"
    path = folder / f"{name}.onnx"
    if not path.exists():
        save_model(build_decoder(weights, BuildOptions("int4", context_length=64, **options)), path)
    return path


def _logits(path, chunks):
    decoder = Decoder(path, capacity=64, threads=1)
    return np.concatenate([decoder.forward(c, len(c))["logits"].reshape(len(c), -1) for c in chunks])


def test_the_native_layout_multiplies_ggufs_blocks(weights, tmp_path):
    path = _path(weights, tmp_path, carry_native=True)
    ops = [(n.op_type, n.domain) for n in onnx.load(str(path), load_external_data=False).graph.node]
    assert ops.count(("MatMulGGUF", "ai.edge_spec")) >= len(weights.layers) * 4
    assert ops.count(("MatMulNBits", "com.microsoft")) == 1  # the LM head, not carried here
    native = _logits(path, [IDS])
    lean = _logits(_path(weights, tmp_path), [IDS])  # the same blocks through MatMulNBits
    assert native.shape == lean.shape
    # the same weights, activations rounded in blocks of 256 instead of 32: close, not equal
    assert not np.array_equal(native, lean)
    assert np.corrcoef(native.ravel(), lean.ravel())[0, 1] > 0.999
    assert (native.argmax(-1) == lean.argmax(-1)).mean() >= 0.9


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(weights, tmp_path):
    path = _path(weights, tmp_path, carry_native=True)
    whole = _logits(path, [IDS])
    parts = _logits(path, [IDS[:1], IDS[1:4], IDS[4:]])
    np.testing.assert_array_equal(parts, whole)


def test_without_the_library_a_native_graph_is_one_clear_error(weights, tmp_path, monkeypatch):
    path = _path(weights, tmp_path, carry_native=True)
    monkeypatch.setattr(build, "required_library_path", lambda: None)
    monkeypatch.setenv("EDGE_SPEC_NATIVE_ATTENTION", "0")
    with pytest.raises(EdgeSpecError, match="does not build here") as caught:
        Decoder(path, capacity=64, threads=1)
    assert "\n" not in str(caught.value)


def test_the_native_layout_is_named_in_the_manifest_and_refuses_the_prompt_reader():
    assert layout_name(False, False, 64, True) == "native"
    with pytest.raises(EdgeSpecError, match="does not take --prompt-reader"):
        ExportOptions(gguf_layout="native", prompt_reader=True).check()
