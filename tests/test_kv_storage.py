"""The device seam: a decoder whose KV cache lives in device-style OrtValues computes what the host one does."""

from __future__ import annotations

import numpy as np

from edge_spec.manifest import read_manifest
from edge_spec.runtime.model.decoder import Decoder
from edge_spec.runtime.model.draft_tree import DraftTree
from edge_spec.runtime.model.kv_cache import DeviceKV, HostKV


def _decoders(bundle):
    path = bundle / read_manifest(bundle)["target"]["onnx"]
    host = Decoder(path, threads=1, capacity=64, half_cache=False)  # device buffers are float32: the same here
    device = Decoder(path, threads=1, capacity=64, kv_device="cpu")  # OrtValues ORT allocated, not numpy views
    return host, device


def test_device_kv_gives_the_host_logits_through_chains_trees_and_rollback(int4_bundle):
    host, device = _decoders(int4_bundle)
    assert isinstance(host.kv, HostKV) and isinstance(device.kv, DeviceKV)
    prompt = [5, 17, 42, 8, 99, 3]
    tree = DraftTree(7, ((11, 12), (13, 14)))
    outputs = []
    for decoder in (host, device):
        run = [decoder.prefill(prompt)["logits"]]
        run.append(decoder.forward([7, 21, 22], 3)["logits"])
        decoder.rewind(len(prompt))  # a rejected chain
        run.append(decoder.forward(tree.tokens, tree.size, tree=tree)["logits"])
        decoder.keep_path(len(prompt), [0, 3, 4])  # the second branch survives: its slots move down
        run.append(decoder.forward([30, 31], 2)["logits"])
        outputs.append(run)
    for got, want in zip(outputs[1], outputs[0]):
        np.testing.assert_array_equal(got, want)


def test_keep_path_moves_the_surviving_branch_in_device_storage(int4_bundle):
    """The compacted cache must equal a cache that read the surviving path as a chain (up to the
    rounding of a tree pass, which sums attention in another order)."""
    host, device = _decoders(int4_bundle)
    prompt = [5, 17, 42, 8]
    device.prefill(prompt)
    device.forward([21, 11, 12, 13, 14], 5, tree=DraftTree(21, ((11, 12), (13, 14))))
    device.keep_path(len(prompt), [0, 3, 4])
    assert device.tokens == prompt + [21, 13, 14]
    compacted = device.forward([30, 31], 2)["logits"]
    host.prefill(prompt + [21, 13, 14])
    chain = host.forward([30, 31], 2)["logits"]
    np.testing.assert_allclose(compacted, chain, atol=2e-3)
    assert np.argmax(compacted[-1]) == np.argmax(chain[-1])
