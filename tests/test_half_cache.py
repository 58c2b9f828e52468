"""The native attention op's float16 key/value cache: half the bytes a pass reads, the same batch invariance."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

from edge_spec.runtime.engine import Engine
from edge_spec.runtime.model.decoder import Decoder
from tests.helpers import chain, greedy_drafts_kept_and_refused, logit_rows

PROMPT = [int(t) for t in np.random.default_rng(5).integers(5, 300, 41)]


@pytest.fixture(autouse=True)
def _native(monkeypatch):
    """These tests run the native op and its float16 cache whatever switches the suite was started with."""
    monkeypatch.setenv("EDGE_SPEC_NATIVE_ATTENTION", "1")
    monkeypatch.delenv("EDGE_SPEC_HALF_CACHE", raising=False)


@pytest.fixture(scope="module")
def target(int4_bundle):
    from edge_spec.manifest import read_manifest

    return int4_bundle / read_manifest(int4_bundle)["target"]["onnx"]


def test_the_cache_is_float16_where_the_native_op_runs_every_attention_node(native_library, target):
    half = Decoder(target, threads=1, capacity=128)
    wide = Decoder(target, threads=1, capacity=128, half_cache=False)
    assert half.native_attention and half.half_cache and half.kv.arrays[0].dtype == np.float16
    assert not wide.half_cache and wide.kv.arrays[0].dtype == np.float32
    assert sum(a.nbytes for a in half.kv.arrays) * 2 == sum(a.nbytes for a in wide.kv.arrays)
    got, expected = logit_rows(half.prefill(PROMPT, 4)), logit_rows(wide.prefill(PROMPT, 4))
    assert not np.array_equal(got, expected)  # the keys and values were rounded
    for a, b in zip(got, expected):
        assert np.corrcoef(a, b)[0, 1] > 0.999
    # what the cache holds: the first layer's keys and values (the same inputs in both) are the float32 cache's
    # rounded to nearest, ties to even (numpy's rule); later layers read what the rounding changed
    for a, b in zip(half.kv.arrays[:2], wide.kv.arrays[:2]):
        np.testing.assert_array_equal(a[:, :, : len(PROMPT)], b[:, :, : len(PROMPT)].astype(np.float16))


@pytest.mark.parametrize(
    "env, native",
    [({"EDGE_SPEC_HALF_CACHE": "0"}, True), ({"EDGE_SPEC_NATIVE_ATTENTION": "0"}, False)],
    ids=["switched-off", "orts-attention"],
)
def test_a_float32_cache_stays_where_asked_or_where_orts_op_reads_it(native_library, target, monkeypatch, env, native):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    decoder = Decoder(target, threads=1, capacity=128)
    assert decoder.native_attention is native and not decoder.half_cache
    assert decoder.kv.arrays[0].dtype == np.float32


def test_a_prompt_graph_shares_a_float32_cache(native_library, tmp_path_factory, tiny_pair):
    """A prompt graph's attention is ONNX Runtime's op on CPUs without AMX: it reads the cache as float32."""
    from edge_spec.manifest import read_manifest
    from tests.helpers import export_tiny

    bundle = export_tiny(tmp_path_factory.mktemp("b") / "reader", tiny_pair, quant="int4", prompt_reader=True)
    manifest = read_manifest(bundle)
    decoder = Decoder(
        bundle / manifest["target"]["onnx"],
        threads=1,
        capacity=128,
        prompt_graph=bundle / manifest["target"]["prompt_reader"]["onnx"],
    )
    assert decoder.native_attention and not decoder.half_cache


def test_a_row_has_the_same_bits_in_one_row_and_in_a_pass_of_many(native_library, target):
    whole = Decoder(target, threads=1, capacity=128)
    logits = logit_rows(whole.prefill(PROMPT, len(PROMPT)))
    stepped = Decoder(target, threads=1, capacity=128)
    stepped.prefill(PROMPT[:20], 1)
    for i in range(20, len(PROMPT)):  # each later row alone, reading the rows before it from the float16 cache
        np.testing.assert_array_equal(logit_rows(stepped.forward([PROMPT[i]]))[-1], logits[i])
    chunked = Decoder(target, threads=1, capacity=128)
    chunked.prefill_chunk = 8
    np.testing.assert_array_equal(logit_rows(chunked.prefill(PROMPT, 4)), logits[-4:])
    for a, b in zip(whole.kv.arrays, chunked.kv.arrays):
        np.testing.assert_array_equal(a[:, :, : len(PROMPT)], b[:, :, : len(PROMPT)])


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_speculative_equals_autoregressive_over_a_float16_cache(native_library, int4_bundle, gamma):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    assert engine.bundle.target.half_cache
    _, refused = greedy_drafts_kept_and_refused(engine, chain(gamma))
    assert refused > 0, "the drafter never disagreed: rollback over a float16 cache not exercised"


def _edge_floats() -> np.ndarray:
    """Floats where rounding to float16 is hard: ties at every scale, the subnormal and overflow edges."""
    with np.errstate(all="ignore"):  # the largest halves' spacing, NaN's cast
        return _hard_floats()


def _hard_floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    finite = halves[np.isfinite(halves)]
    ulp = np.spacing(finite.astype(np.float16)).astype(np.float32)
    ties = finite + ulp / 2  # exactly halfway to the next float16 (even or odd below)
    near = np.concatenate([ties, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))])
    edges = np.array([65504, 65519.996, 65520, 1e9, 5.96e-8, 2.98e-8, 2.9802322e-08, 1e-30, 0.0, -0.0], np.float32)
    wide = rng.standard_normal(1 << 16).astype(np.float32) * rng.choice([1e-6, 1e-3, 1, 30, 3e4], 1 << 16)
    values = np.concatenate([halves, near, edges, -edges, wide, [np.inf, -np.inf, np.nan]]).astype(np.float32)
    return values[np.isfinite(values) | np.isinf(values) | np.isnan(values)]


@pytest.mark.parametrize("portable", [1, 0], ids=["portable", "f16c"])
def test_the_conversions_round_to_nearest_even_as_numpy_does(native_library, portable):
    library = ctypes.CDLL(str(native_library))
    values = np.ascontiguousarray(_edge_floats())
    got = np.empty(len(values), np.uint16)
    back = np.empty(len(values), np.float32)
    f = library.EdgeSpecRoundToHalf
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f(values.ctypes.data, got.ctypes.data, back.ctypes.data, len(values), portable)
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16)
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan], expected[~nan].view(np.uint16))
    assert np.isnan(got[nan].view(np.float16)).all()
    np.testing.assert_array_equal(back[~nan], expected[~nan].astype(np.float32))


def array_in_child(code: str, target, env: dict[str, str], out) -> np.ndarray:
    """The array ``code`` saves to ``sys.argv[2]``, run on the target ``sys.argv[1]`` in a child started with the
    native op and ``env`` (the library picks its kernels and prefetches from the switches at load, once a process)."""
    done = subprocess.run(
        [sys.executable, "-c", code, str(target), str(out)],
        env={**os.environ, "EDGE_SPEC_NATIVE_ATTENTION": "1", **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return np.load(out)


def test_the_scalar_kernels_fill_the_cache_as_the_vector_ones_do(native_library, target, tmp_path):
    """The portable path (no AVX2) rounds its keys and values to the same float16 values (its own scores and
    sums round differently, as they do with a float32 cache)."""
    code = (
        "import sys, numpy as np; from edge_spec.runtime.model.decoder import Decoder; "
        f"d = Decoder(sys.argv[1], threads=1, capacity=128); d.prefill({PROMPT!r}); "
        "np.save(sys.argv[2], np.stack([a[:, :, :41] for a in d.kv.arrays]))"
    )
    caches = {
        name: array_in_child(code, target, env, tmp_path / f"{name}.npy")
        for name, env in (("vector", {}), ("scalar", {"EDGE_SPEC_NATIVE_SCALAR": "1"}))
    }
    assert caches["vector"].dtype == np.float16
    # the first layer's keys and values come from the same embedding and matmuls on both paths
    np.testing.assert_array_equal(caches["scalar"][:2], caches["vector"][:2])


@pytest.mark.parametrize("kernels", [{}, {"EDGE_SPEC_NATIVE_AVX512": "0"}], ids=["vector", "avx2"])
def test_reading_the_cache_ahead_keeps_every_bit(native_library, target, kernels, tmp_path):
    """Where the far prefetch is on, a decode or verify pass asks for the float16 tiles it will read back next;
    after a prompt of many tiles the logits of one-row and five-row passes are those it gives with it off."""
    prompt = [int(t) for t in np.random.default_rng(6).integers(5, 300, 230)]
    code = (
        "import sys, numpy as np; from edge_spec.runtime.model.decoder import Decoder; "
        f"d = Decoder(sys.argv[1], threads=2, capacity=320); d.prefill({prompt!r}); "
        "a = d.forward([7], num_logits=1)['logits'].reshape(-1, d.vocab_size); "
        "b = d.forward([11, 12, 13, 14, 15], num_logits=5)['logits'].reshape(-1, d.vocab_size); "
        "np.save(sys.argv[2], np.concatenate([a, b]))"
    )
    logits = {
        far: array_in_child(code, target, {"EDGE_SPEC_NATIVE_FAR_PREFETCH": far, **kernels}, tmp_path / f"{far}.npy")
        for far in ("1", "0")
    }
    assert logits["1"].shape[0] == 6 and np.abs(logits["1"]).max() > 0
    np.testing.assert_array_equal(logits["1"], logits["0"])


def test_device_facts_are_kept_apart_for_a_float16_cache(native_library, int4_bundle, monkeypatch):
    """Cost profiles measured over one cache type are not read for the other (a pass reads other bytes)."""
    half = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    monkeypatch.setenv("EDGE_SPEC_HALF_CACHE", "0")
    wide = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    assert half.bundle.target.half_cache and not wide.bundle.target.half_cache
    assert half.bundle._placement() != wide.bundle._placement()


def test_a_float32_export_keeps_a_float32_cache(native_library, fp32_bundle):
    """The float32 export is the reference against transformers: its cache is not rounded."""
    from edge_spec.manifest import read_manifest

    decoder = Decoder(fp32_bundle / read_manifest(fp32_bundle)["target"]["onnx"], threads=1, capacity=64)
    assert decoder.native_attention and not decoder.half_cache


def test_a_cache_on_a_device_style_buffer_stays_float32(native_library, target):
    decoder = Decoder(target, threads=1, capacity=64, kv_device="cpu")
    assert not decoder.half_cache and decoder.kv.values[0].data_type() == "tensor(float)"
