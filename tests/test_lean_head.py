"""The lean layout's LM head: 4-bit logits everywhere, each position's best rows scored again at 8 bits."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from edge_spec.export.gguf.blocks import carry_gguf  # noqa: E402
from edge_spec.export.graph.builder import BuildOptions, build_decoder, save_model  # noqa: E402
from edge_spec.runtime.model.decoder import Decoder  # noqa: E402
from tests import tiny_models  # noqa: E402

RESCORED = 8
IDS = [5, 17, 42, 99, 7, 230, 64, 3]


@pytest.fixture(scope="module")
def weights(tiny_pair):
    """The tiny target with its (tied) LM head carried as Q8_0 blocks, as a Q4_K_M GGUF's Q6_K head is."""
    tokenizer, target, _ = tiny_pair
    w = tiny_models.loaded("t", target, tokenizer).weights
    head = w.lm_head
    w.carried["lm_head"] = carry_gguf(quants.quantize(head, T.Q8_0), "Q8_0", *head.shape)
    return w


@pytest.fixture(scope="module")
def logits(weights, tmp_path_factory):
    """Logits of every position of IDS in one pass, per layout (int8 activations, as shipped)."""
    folder = tmp_path_factory.mktemp("lean")
    out = {}
    for name, options in {
        "fast": {},
        "small": dict(carry_narrow=True),  # here the LM head is the only 8-bit matrix: small narrows it alone
        "lean": dict(head_rescore=RESCORED),
    }.items():
        out[name] = _run(weights, folder / f"{name}.onnx", [IDS], **options)[0]
    return out


def _run(weights, path, chunks, quant="int4", **options):
    """Each chunk's logits (all its positions), the chunks fed one pass each into one cache."""
    if not path.exists():
        save_model(build_decoder(weights, BuildOptions(quant, context_length=64, **options)), path)
    decoder = Decoder(path, capacity=64, threads=1)
    return [decoder.forward(chunk, len(chunk))["logits"].reshape(len(chunk), -1) for chunk in chunks]


def test_rows_outside_the_best_ones_are_the_4_bit_heads_logits(logits):
    lean, coarse = logits["lean"], logits["small"]
    top = np.argsort(-coarse, axis=-1, kind="stable")[:, :RESCORED]
    outside = np.ones_like(coarse, dtype=bool)
    np.put_along_axis(outside, top, False, axis=-1)
    np.testing.assert_array_equal(lean[outside], coarse[outside])
    assert not np.array_equal(lean[~outside], coarse[~outside])  # negative control: the best rows moved


def test_the_best_rows_are_scored_as_closely_as_the_8_bit_head(logits):
    """Against the 8-bit head over the same 4-bit body (``fast``): the re-scored rows are far closer
    than the 4-bit head's, and every position picks the same token."""
    lean, coarse, fast = logits["lean"], logits["small"], logits["fast"]
    top = np.argsort(-coarse, axis=-1, kind="stable")[:, :RESCORED]
    picked = {name: np.take_along_axis(values, top, axis=-1) for name, values in logits.items()}
    lean_error = np.abs(picked["lean"] - picked["fast"]).max()
    assert lean_error < np.abs(picked["small"] - picked["fast"]).max() / 5
    np.testing.assert_array_equal(lean.argmax(-1), fast.argmax(-1))


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(weights, tmp_path):
    path = tmp_path / "lean.onnx"
    whole = _run(weights, path, [IDS], head_rescore=RESCORED)[0]
    parts = np.concatenate(_run(weights, path, [IDS[:2], IDS[2:5], IDS[5:]], head_rescore=RESCORED))
    np.testing.assert_array_equal(parts, whole)


def test_the_lean_layout_shares_the_embedding_table_of_a_tied_head(weights, tmp_path):
    import onnx

    lean, fast = tmp_path / "lean.onnx", tmp_path / "fast.onnx"
    save_model(build_decoder(weights, BuildOptions("int4", context_length=64, head_rescore=RESCORED)), lean)
    save_model(build_decoder(weights, BuildOptions("int4", context_length=64)), fast)
    graph = onnx.load(str(lean), load_external_data=False).graph
    gathers = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    assert {n.input[0] for n in gathers} == {"embed.qweight"} and len(gathers) == 2
    bits = {
        n.name: next(a.i for a in n.attribute if a.name == "bits") for n in graph.node if n.op_type == "MatMulNBits"
    }
    assert bits["lm_head/out/MatMulNBits"] == 4
    # the 4-bit head is smaller than the 8-bit one, and no second table came with it
    size = {p: sum(f.stat().st_size for f in tmp_path.glob(p.name + "*")) for p in (lean, fast)}
    assert size[lean] < size[fast]
