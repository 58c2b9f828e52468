"""Exporter + autoregressive runtime on tiny models: exactness against PyTorch, manifest, API behaviour."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from edge_spec.errors import EdgeSpecError
from edge_spec.export.graph.quantize import quantize_blockwise
from edge_spec.manifest import read_manifest, sha256_file, verify_files
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import loop_config
from edge_spec.runtime.model.decoder import Decoder
from tests import tiny_models
from tests.helpers import decoder_greedy, export_tiny

PROMPTS = [[5, 17, 42, 99], [3], list(range(10, 40))]


def onnx_greedy(bundle, prompt, n):
    manifest = read_manifest(bundle)
    return decoder_greedy(Decoder(bundle / manifest["target"]["onnx"], capacity=128), prompt, n)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_fp32_export_matches_pytorch_greedy(fp32_bundle, tiny_pair, prompt):
    _, target, _ = tiny_pair
    assert onnx_greedy(fp32_bundle, prompt, 24) == tiny_models.torch_greedy(target, prompt, 24)


def test_fp32_logits_match_pytorch(fp32_bundle, tiny_pair):
    _, target, _ = tiny_pair
    manifest = read_manifest(fp32_bundle)
    decoder = Decoder(fp32_bundle / manifest["target"]["onnx"], capacity=64)
    ids = [7, 8, 9, 10, 11, 12]
    got = np.concatenate([decoder.forward(ids[:4], 4)["logits"], decoder.forward(ids[4:], 2)["logits"]])
    with torch.no_grad():
        ref = target(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4)


def fake_quantized(model, bits=4, block=32):
    """PyTorch model whose weights are replaced by their int4 reconstruction (what the int4 graph computes)."""
    import copy

    q = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in q.named_parameters():
            if param.ndim == 2:
                deq = quantize_blockwise(param.numpy(), bits, block).dequantize()
                param.copy_(torch.from_numpy(deq))
    return q


def test_int4_export_matches_fake_quantized_pytorch(tmp_path, tiny_pair):
    bundle = export_tiny(tmp_path / "int4acc0", tiny_pair, quant="int4", accuracy_level=0)
    _, target, _ = tiny_pair
    reference = fake_quantized(target)
    for prompt in PROMPTS:
        assert onnx_greedy(bundle, prompt, 24) == tiny_models.torch_greedy(reference, prompt, 24)


def test_quantize_roundtrip_error_is_small():
    w = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    for bits, tol in ((4, 0.2), (8, 0.012)):
        q = quantize_blockwise(w, bits, 32)
        err = np.abs(q.dequantize() - w).max() / np.abs(w).max()
        assert err < tol
    # a block's largest-magnitude value is reconstructed exactly (it defines the scale)
    q = quantize_blockwise(w, 4, 32)
    blocks = w.reshape(8, 3, 32)
    i = np.abs(blocks).argmax(-1)
    np.testing.assert_allclose(
        np.take_along_axis(q.dequantize().reshape(8, 3, 32), i[..., None], -1),
        np.take_along_axis(blocks, i[..., None], -1),
        rtol=1e-6,
    )


def test_manifest_roundtrip(int4_bundle):
    manifest = read_manifest(int4_bundle)
    verify_files(int4_bundle, manifest, full_hash=True)
    target = manifest["target"]
    assert target["config"]["num_layers"] == 2
    assert target["config"]["vocab_size"] == 384
    assert target["quantization"]["weights"] == "int4"
    heads = manifest["draft"]["heads"]
    assert set(heads) == {
        "full",
        "trim-160",
        "trim-64",
        "specvocab-r16-k48",
        "trim32+specvocab-r16-k48",
        "specvocab-r16-k48-of160",
        "trim32+specvocab-r16-k48-of160",
    }
    assert manifest["draft"]["default_head"] == "trim-160"
    assert heads["trim-64"]["size"] == 64 and heads["full"]["size"] == 384
    assert (int4_bundle / "draft" / "token_counts.npy").is_file()
    for record in target["files"] + manifest["draft"]["files"]:
        assert sha256_file(int4_bundle / record["path"]) == record["sha256"]
    assert (int4_bundle / "tokenizer.json").is_file()


def test_kv_rollback_equals_fresh_forward(int4_bundle):
    manifest = read_manifest(int4_bundle)
    path = int4_bundle / manifest["target"]["onnx"]
    decoder = Decoder(path, capacity=64)
    decoder.forward([1, 2, 3, 4, 5, 6, 7, 8], 1)
    decoder.rewind(5)
    after_rollback = decoder.forward([9, 10], 2)["logits"]
    fresh = Decoder(path, capacity=64)
    reference = fresh.forward([1, 2, 3, 4, 5, 9, 10], 2)["logits"]
    np.testing.assert_allclose(after_rollback, reference, atol=1e-5)


def test_engine_generate_streams_text_and_stats(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    chunks = list(engine.generate([{"role": "user", "content": "def is_prime"}], max_new_tokens=12))
    completion = engine.complete([{"role": "user", "content": "def is_prime"}], max_new_tokens=12)
    assert "".join(chunks) == completion.text
    # greedy, so fixed: this answer runs to the limit (an eos would stop it short and say so)
    assert completion.stats.new_tokens == len(completion.token_ids) == 12
    assert completion.stats.stop_reason == "length"
    # decoding the ids gives the streamed text
    assert engine.bundle.tokenizer.decode(completion.token_ids) == completion.text


def test_engine_prefix_reuse_gives_same_answer(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    first = engine.complete("The quick brown fox", max_new_tokens=10).token_ids
    engine.complete("Summarize: speculative", max_new_tokens=5)
    again = engine.complete("The quick brown fox", max_new_tokens=10).token_ids
    assert first == again


def test_stop_string_truncates(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    answer = engine.complete("What is 12", max_new_tokens=12)
    full = answer.text
    # precondition (greedy, so fixed): the answer runs to the limit and has text to cut
    assert answer.stats.stop_reason == "length" and len(full) >= 4, (answer.stats.stop_reason, full)
    stop = full[2:4]
    cut = engine.complete("What is 12", max_new_tokens=12, stop=[stop])
    assert cut.text == full[: full.find(stop)]
    assert cut.stats.stop_reason == "stop"


def test_sampling_is_reproducible_with_seed(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    a = engine.complete("hello", max_new_tokens=16, temperature=0.9, top_p=0.95, seed=3).token_ids
    b = engine.complete("hello", max_new_tokens=16, temperature=0.9, top_p=0.95, seed=3).token_ids
    assert a == b


def test_cancel_from_another_thread(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    uncancelled = engine.complete("hello", max_new_tokens=200, temperature=1.0, seed=0)
    stream = engine.generate("hello", max_new_tokens=200, temperature=1.0, seed=0)
    next(stream)  # the stream is paused after its first chunk while another thread cancels
    decoded = len(engine.last_token_ids)
    canceller = threading.Thread(target=engine.cancel)
    canceller.start()
    canceller.join()
    list(stream)
    stats = engine.last_stats
    # stopped by the cancel, before the next token: not by eos, which the same seed reaches only much later
    assert stats.stop_reason == "cancelled"
    assert stats.new_tokens == decoded < uncancelled.stats.new_tokens
    assert engine.last_token_ids == uncancelled.token_ids[:decoded]


def test_prompt_longer_than_context_is_rejected(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, context_length=16, mode="ar")
    with pytest.raises(EdgeSpecError, match="longer than the context"):
        engine.complete("word " * 40)


def test_a_context_too_short_to_draft_in_is_one_clear_error(int4_bundle):
    with pytest.raises(EdgeSpecError, match="too short for speculative decoding.* at least 12 tokens"):
        Engine.from_bundle(int4_bundle, threads=1, context_length=10, mode="spec")
    with pytest.raises(EdgeSpecError, match="drafts of up to 8 tokens: give a context of at least 20 tokens"):
        Engine.from_bundle(
            int4_bundle, threads=1, context_length=16, config=loop_config("spec", gamma=8, schedule="fixed")
        )


def test_the_default_ceiling_shrinks_to_a_short_context_and_answers_as_ar(int4_bundle):
    # the adaptive ceiling is only a ceiling: a context shorter than its drafts' room still speculates
    spec = Engine.from_bundle(int4_bundle, threads=1, context_length=48, mode="spec")
    ar = Engine.from_bundle(int4_bundle, threads=1, context_length=48, mode="ar")
    prompt = "the quick brown fox"
    answer = spec.complete(prompt, max_new_tokens=12)
    assert answer.token_ids == ar.complete(prompt, max_new_tokens=12).token_ids
    assert answer.stats.new_tokens == 12 and max(spec.bundle.cost_profile.verify) == 23


def test_unknown_provider_is_rejected(int4_bundle):
    with pytest.raises(EdgeSpecError, match="unknown provider"):
        Engine.from_bundle(int4_bundle, provider="tpu")


def test_tokenizer_mismatch_is_rejected(tmp_path, tiny_pair):
    from edge_spec.export.bundle.build import ExportOptions, export_bundle

    tokenizer, target, draft = tiny_pair
    other = tiny_models.make_tokenizer(specials=["<|endoftext|>", "<|im_end|>", "<|im_start|>"])
    models = {
        "t": tiny_models.loaded("t", target, tokenizer),
        "d": tiny_models.loaded("d", draft, other),
    }
    with pytest.raises(EdgeSpecError, match="token id 1"):
        export_bundle("t", "d", tmp_path / "x", ExportOptions(context_length=64), loader=models.__getitem__)


def _blocks_of(onnx_path, k_wide: int) -> set[tuple[int, int]]:
    """(K, block size) of every MatMulNBits node, and the GatherBlockQuantized table's (hidden, block)."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    found = set()
    for node in graph.node:
        attrs = {a.name: a.i for a in node.attribute}
        if node.op_type == "MatMulNBits":
            found.add((attrs["K"], attrs["block_size"]))
        elif node.op_type == "GatherBlockQuantized":
            found.add((k_wide, attrs["block_size"]))
    return found


def test_drafter_blocks_are_its_own(int4_bundle, tmp_path, tiny_pair):
    """The drafter is re-quantized at ``draft_block_size`` (default 128: its rounding moves acceptance
    only), the target keeps ``block_size``; both are recorded, and the drafter's heads follow its body.
    A K (or an embedding row) narrower than the block gets the widest block that divides it: the tiny
    models' K are 64 and 128."""
    from edge_spec.export.graph.builder import row_block_size

    manifest = read_manifest(int4_bundle)
    assert manifest["target"]["quantization"]["block_size"] == 32
    assert manifest["draft"]["quantization"]["block_size"] == 128
    hidden = manifest["draft"]["config"]["hidden_size"]
    target = _blocks_of(int4_bundle / manifest["target"]["onnx"], hidden)
    drafter = _blocks_of(int4_bundle / manifest["draft"]["onnx"], hidden)
    head = _blocks_of(int4_bundle / manifest["draft"]["heads"]["trim-64"]["onnx"], hidden)
    assert {block for _, block in target} == {32}
    assert drafter == {(64, 64), (128, 128)} and head == {(64, 64)}
    assert row_block_size(896, 128) == 128 and row_block_size(192, 128) == 64 and row_block_size(40, 128) == 16

    other = export_tiny(tmp_path / "b32", tiny_pair, draft_block_size=32, draft_vocab="trim", keep=(64,))
    again = read_manifest(other)
    assert again["draft"]["quantization"]["block_size"] == 32
    assert {block for _, block in _blocks_of(other / again["draft"]["onnx"], hidden)} == {32}


def test_the_python_api_runs_speculative_decoding_by_default(int4_bundle):
    """The same default as the CLI and the server: a user who names no mode gets speculation."""
    with Engine.from_bundle(int4_bundle, threads=1) as engine:
        assert engine.config.mode == "spec"
        answer = engine.complete("def is_prime", max_new_tokens=8)
        assert answer.stats.spec is not None and answer.stats.spec.target_calls > 0


def test_close_releases_the_sessions_and_refuses_later_calls(int4_bundle):
    """After close() the ONNX Runtime sessions are gone even while something (a timer's callback) still
    holds the engine; a later call is one clear error."""
    import gc
    import weakref

    from edge_spec.runtime.engine import EngineClosed

    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    engine.complete("hello", max_new_tokens=4)
    sessions = [
        weakref.ref(engine.bundle.target.session),
        weakref.ref(engine.bundle.active_drafter(engine.config).decoder.session),
    ]
    keeps_it_alive = engine.cancel  # a bound method holds the engine, as a threading.Timer would
    engine.close()
    gc.collect()
    assert [ref() for ref in sessions] == [None, None]
    with pytest.raises(EngineClosed, match="closed"):
        engine.complete("hello", max_new_tokens=4)
    keeps_it_alive()  # cancel stays harmless


def test_a_context_manager_closes_the_engine(int4_bundle):
    with Engine.from_bundle(int4_bundle, threads=1, mode="ar") as engine:
        assert engine.complete("hello", max_new_tokens=2).token_ids
    with pytest.raises(EdgeSpecError, match="closed"):
        engine.complete("hello", max_new_tokens=2)
