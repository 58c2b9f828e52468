"""The WebGPU tier: the runtime on the WebGPU execution provider (``onnxruntime-webgpu`` and a GPU adapter;
``.ci/webgpu`` sets both up over Mesa's lavapipe).  Elsewhere every test skips with the reason in one line.

What "exact" means on a GPU EP: its kernels round differently from the CPU EP's (WebGPU's int4
MatMulNBits quantizes activations its own way), so WebGPU results are compared with WebGPU results only.
Speculative greedy output must equal target-only greedy output run through batch-invariant passes on the
same EP (``ar --exact``); that holds where the EP's passes of 2 and more rows give each row the same
result however the sequence is cut, which ``test_webgpu_passes_are_batch_invariant`` checks first.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from edge_spec.manifest import read_manifest
from edge_spec.runtime.model.providers import exact_min_rows, provider_report

WHY_NOT = dict(provider_report()).get("webgpu", "")
pytestmark = [
    pytest.mark.webgpu,
    pytest.mark.skipif(not WHY_NOT.startswith("usable"), reason=f"no WebGPU execution provider: {WHY_NOT}"),
]

from edge_spec.runtime.engine import Engine  # noqa: E402
from edge_spec.runtime.loops.config import SsdConfig  # noqa: E402
from edge_spec.runtime.model.decoder import Decoder  # noqa: E402
from edge_spec.runtime.model.draft_tree import DraftTree  # noqa: E402
from edge_spec.runtime.model.kv_cache import DeviceKV, HostKV  # noqa: E402
from edge_spec.runtime.model.row_invariance import logits_by_passes  # noqa: E402
from edge_spec.runtime.verify.sampling import SamplingParams  # noqa: E402
from tests.helpers import chain, chi_square_same_distribution, first_tokens, run  # noqa: E402

PROMPT = [5, 17, 42, 8, 99, 3]
SEQUENCE = PROMPT + [11, 12, 301, 77, 8, 8, 140, 33, 21, 9]


def _target(bundle):
    return bundle / read_manifest(bundle)["target"]["onnx"]


@pytest.fixture(scope="module")
def gpu_engine(int4_bundle):
    return Engine.from_bundle(int4_bundle, provider="webgpu", mode="spec", draft_head="full")


def _passes(decoder: Decoder) -> list[np.ndarray]:
    """A chain, a rejected chain rolled back, a draft tree compacted to its second branch, a chain."""
    tree = DraftTree(7, ((11, 12), (13, 14)))
    out = [decoder.prefill(PROMPT)["logits"], decoder.forward([7, 21, 22], 3)["logits"]]
    decoder.rewind(len(PROMPT))
    out.append(decoder.forward(tree.tokens, tree.size, tree=tree)["logits"])
    decoder.keep_path(len(PROMPT), [0, 3, 4])
    out.append(decoder.forward([30, 31], 2)["logits"])
    return out


def test_kv_cache_stays_on_the_device(int4_bundle):
    """Only a host cache crosses the bus (ORT copies it in and out every pass; on WebGPU it also computes
    wrong logits: past and present are then different buffers, a GroupQueryAttention path the bundle's
    shared-buffer graphs are not meant for)."""
    device = Decoder(_target(int4_bundle), provider="webgpu", capacity=64)
    host = Decoder(_target(int4_bundle), provider="webgpu", capacity=64, kv_device="host")
    assert isinstance(device.kv, DeviceKV) and isinstance(host.kv, HostKV)
    _passes(device), _passes(host)
    assert device.transfers.kv == 0 and host.transfers.kv > 0
    assert device.transfers.passes == host.transfers.passes == 4
    kv_bytes = sum(v.numpy().nbytes for v in device.kv.values)
    assert 0 < device.transfers.host_to_device < kv_bytes / 10  # ids, lengths, positions, bias, slot indices


def test_keep_path_on_device_moves_exactly_the_kept_slots(int4_bundle):
    decoder = Decoder(_target(int4_bundle), provider="webgpu", capacity=64)
    decoder.prefill(PROMPT)
    tree = DraftTree(21, ((11, 12), (13, 14)))
    decoder.forward(tree.tokens, tree.size, tree=tree)
    before = [v.numpy().copy() for v in decoder.kv.values]
    start = len(PROMPT)
    decoder.keep_path(start, [0, 3, 4])
    for old, value in zip(before, decoder.kv.values):
        new = value.numpy()
        np.testing.assert_array_equal(new[:, :, start + 1 : start + 3], old[:, :, [start + 3, start + 4]])
        np.testing.assert_array_equal(new[:, :, : start + 1], old[:, :, : start + 1])


def test_a_decoder_can_be_dropped_when_it_holds_the_last_session(int4_bundle):
    """Its cache buffers must go before its session: freed after the device's last session closed, they
    crashed the process (a segfault, so the check runs in a child process)."""
    code = (
        "import sys; from edge_spec.runtime.model.decoder import Decoder\n"
        "d = Decoder(sys.argv[1], provider='webgpu', capacity=32); d.forward([5, 17, 42], 1)\n"
        "del d; print('dropped')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(_target(int4_bundle))], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "dropped" in done.stdout, done.stderr[-500:]


def test_rewind_on_device_equals_a_fresh_forward(int4_bundle):
    rewound = Decoder(_target(int4_bundle), provider="webgpu", capacity=64)
    fresh = Decoder(_target(int4_bundle), provider="webgpu", capacity=64)
    rewound.prefill(PROMPT)
    rewound.forward([250, 61, 9], 3)  # rejected
    rewound.rewind(len(PROMPT))
    fresh.prefill(PROMPT)
    np.testing.assert_array_equal(rewound.forward([30, 31, 32], 3)["logits"], fresh.forward([30, 31, 32], 3)["logits"])


def test_webgpu_passes_are_batch_invariant(int4_bundle):
    """The premise of exact speculative greedy on this EP: passes padded to its batch-invariant row count
    give every row the same logits however the sequence is cut."""
    decoder = Decoder(_target(int4_bundle), provider="webgpu", capacity=64, min_rows=exact_min_rows("webgpu"))
    cuts = ([2] * 5, [3, 2, 5], [4, 4, 2], [5, 5], [1] * 10)
    results = []
    for sizes in cuts:
        decoder.reset()
        decoder.forward(PROMPT, 1)
        results.append(logits_by_passes(decoder, SEQUENCE[len(PROMPT) :], sizes))
    for sizes, got in zip(cuts[1:], results[1:]):
        np.testing.assert_array_equal(got, results[0], err_msg=f"passes {sizes} vs {cuts[0]}")


@pytest.mark.parametrize("config", [chain(1), chain(3), chain(4, adaptive=True)])
def test_spec_greedy_equals_exact_target_only_on_webgpu(gpu_engine, config):
    greedy = SamplingParams()
    gpu_engine.bundle.target.min_rows = exact_min_rows("webgpu")
    for prompt in ("def is_prime", "The quick brown fox"):
        ids = gpu_engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(gpu_engine, ids, greedy, 24, None)
        got, stats = run(gpu_engine, ids, greedy, 24, config)
        assert got == reference, f"{config} {prompt!r}"
    assert gpu_engine.bundle.target.transfers.kv == 0


@pytest.mark.parametrize("target, drafter", [("webgpu", "cpu"), ("cpu", "webgpu")])
def test_split_placement_spec_and_ssd_equal_target_only(int4_bundle, target, drafter):
    engine = Engine.from_bundle(int4_bundle, provider=target, draft_provider=drafter, mode="spec", draft_head="full")
    assert engine.bundle.target.session.get_providers()[0].lower().startswith(target)
    assert engine.bundle.drafter.body.session.get_providers()[0].lower().startswith(drafter)
    engine.bundle.target.min_rows = exact_min_rows(target)
    ids = engine.bundle.tokenizer.encode("def is_prime")
    reference, _ = run(engine, ids, SamplingParams(), 20, None)
    for config in (chain(2), SsdConfig(gamma=1)):
        got, _ = run(engine, ids, SamplingParams(), 20, config)
        assert got == reference, f"{target}/{drafter} {config}"


def test_sampled_speculative_keeps_the_target_distribution_on_webgpu(gpu_engine):
    params = SamplingParams(temperature=1.0)
    ids = gpu_engine.bundle.tokenizer.encode("The quick")
    n = 400
    ar = first_tokens(gpu_engine, ids, params, None, n, n_tokens=2)
    spec = first_tokens(gpu_engine, ids, params, chain(2), n, n_tokens=2, seed_offset=10**6)
    assert chi_square_same_distribution(ar, spec) > 1e-3
