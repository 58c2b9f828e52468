"""The EAGLE head as a proposer: greedy output equals target-only decoding, sampling keeps the target's
distribution, the head reads the target's features of every kept position (prompt, chat prefix, verify)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import loop_config
from edge_spec.runtime.verify.sampling import SamplingParams
from tests.helpers import (
    PROMPTS,
    eagle,
    export_tiny,
    greedy_matches_target_only,
    random_head,
    run,
    sampled_matches_target,
    tiny_head_config,
)


@pytest.fixture(scope="module")
def eagle_bundle(tmp_path_factory, tiny_pair):
    from edge_spec.export.eagle.attach import attach_eagle_head

    bundle = export_tiny(tmp_path_factory.mktemp("eagle") / "int4", tiny_pair, quant="int4")
    config = tiny_head_config(feature_layers=(0, 1, 1), draft_vocab_size=384)  # the tiny target has 2 layers
    attach_eagle_head(bundle, config, random_head(seed=3, config=config))
    return bundle


@pytest.fixture(scope="module")
def engine(eagle_bundle):
    return Engine.from_bundle(eagle_bundle, threads=1, config=loop_config("spec", drafter="eagle"), exact=True)


@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_greedy_eagle_equals_target_only_decoding(engine, gamma):
    assert greedy_matches_target_only(engine, eagle(gamma)) > 0, "the head never drafted"


def test_coupled_sampled_eagle_equals_coupled_target_only_decoding(engine):
    """The head races with the noise of the position it drafts, like the drafter model (verify.coupled)."""
    engine.bundle.target.min_rows = engine.bundle.pass_rows("spec")
    drafted = 0
    for seed, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0.8, sampler="coupled", seed=seed)
        ids = engine.bundle.tokenizer.encode(prompt)
        reference, _ = run(engine, ids, params, 30, None)
        got, stats = run(engine, ids, params, 30, eagle(3))
        assert got == reference, prompt
        drafted += sum(stats.drafted)
    assert drafted > 0, "the head never drafted"


def test_the_head_reads_the_features_of_every_kept_position(engine):
    """After a request, the head holds one fused feature per target position, computed from the
    target's own hidden states: the same rows a fresh teacher-forced target pass gives."""
    engine.bundle.target.min_rows = 2
    ids = engine.bundle.tokenizer.encode(PROMPTS[0])
    got, _ = run(engine, ids, SamplingParams(), 24, eagle(3))
    head = engine.bundle.eagle
    committed = ids + got
    kept = committed[: engine.bundle.target.length]
    assert head.feature_tokens == kept
    engine.bundle.target.reset()
    features = engine.bundle.target.prefill(kept, 1)["features"]
    fused = head.fc.run(None, {"features": features[None]})[0][0]
    np.testing.assert_allclose(head.fused[: len(kept)], fused, rtol=1e-4, atol=1e-4)


def test_a_chat_turn_reuses_the_prefix_and_still_equals_target_only(eagle_bundle):
    engine = Engine.from_bundle(
        eagle_bundle, threads=1, config=loop_config("spec", drafter="eagle", gamma=3, schedule="fixed")
    )
    first = [{"role": "user", "content": "def is_prime(n):"}]
    answer = engine.complete(first, max_new_tokens=16)
    second = first + [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "and fib?"}]
    got = engine.complete(second, max_new_tokens=16)
    assert got.stats.prompt_tokens > 0
    ar = engine.complete(second, max_new_tokens=16, mode="ar", exact=True)
    assert got.token_ids == ar.token_ids
    # an answer in another mode moved the target's cache without the head: the next request recomputes
    again = engine.complete(second, max_new_tokens=16)
    assert again.token_ids == ar.token_ids


@pytest.mark.slow
def test_sampled_eagle_matches_target_distribution(engine):
    sampled_matches_target(engine, eagle(2))


def test_eagle_is_refused_where_it_cannot_draft(int4_bundle):
    with pytest.raises(EdgeSpecError, match="^--drafter does not apply to --mode ssd"):
        loop_config("ssd", drafter="eagle")
    with pytest.raises(EdgeSpecError, match="--drafter must be one of"):
        loop_config("spec", drafter="medusa")
    with pytest.raises(EdgeSpecError, match="no EAGLE head"):
        Engine.from_bundle(int4_bundle, threads=1, config=loop_config("spec", drafter="eagle"))


def test_a_saved_head_installs_into_another_export_of_the_same_target(eagle_bundle, engine, tmp_path, tiny_pair):
    """How a trained head ships: saved from one bundle, installed into a fresh export of the same target
    weights without torch, it drafts the same tokens; a bundle of other weights refuses it."""
    from edge_spec.export.eagle.attach import install_eagle_files, save_eagle_files
    from tests import tiny_models

    shipped = save_eagle_files(eagle_bundle, tmp_path / "shipped")
    fresh = export_tiny(tmp_path / "fresh", tiny_pair, quant="int4")
    install_eagle_files(fresh, shipped)
    for name in ("layer.onnx.data", "head_full.onnx.data", "fc.onnx.data", "d2t.npy"):
        assert (fresh / "eagle" / name).read_bytes() == (eagle_bundle / "eagle" / name).read_bytes()
    other_engine = Engine.from_bundle(fresh, threads=1, config=engine.config, exact=True)
    prompt = [{"role": "user", "content": PROMPTS[1]}]
    got = other_engine.complete(prompt, max_new_tokens=16)
    want = engine.complete(prompt, max_new_tokens=16)
    assert got.token_ids == want.token_ids and got.stats.spec.accepted_lengths == want.stats.spec.accepted_lengths
    other = (tiny_models.make_tokenizer(), tiny_models.make_qwen2(seed=7), tiny_pair[2])
    stranger = export_tiny(tmp_path / "stranger", other, quant="int4")
    with pytest.raises(EdgeSpecError, match="trained for other target weights"):
        install_eagle_files(stranger, shipped)
    assert not (stranger / "eagle").exists() and not (stranger / "eagle.partial").exists()


def test_add_heads_attaches_a_specforge_checkpoint_or_a_saved_head(eagle_bundle, tmp_path, tiny_pair):
    import shutil

    from typer.testing import CliRunner

    from edge_spec.cli import app
    from edge_spec.export.eagle.attach import save_eagle_files
    from edge_spec.export.eagle.model import save_specforge
    from edge_spec.manifest import read_manifest

    config = tiny_head_config(feature_layers=(0, 1, 1))
    checkpoint = save_specforge(tmp_path / "specforge", config, random_head(seed=5, config=config))
    plain = export_tiny(tmp_path / "plain", tiny_pair, quant="int4")
    result = CliRunner().invoke(app, ["add-heads", str(plain), "--eagle", str(checkpoint)])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(plain)
    assert manifest["eagle"]["source"] == str(checkpoint) and set(manifest["draft"]["heads"]) == {"full"}
    shutil.rmtree(plain / "eagle")
    saved = save_eagle_files(eagle_bundle, tmp_path / "saved")
    result = CliRunner().invoke(app, ["add-heads", str(plain), "--eagle", str(saved)])
    assert result.exit_code == 0, result.output
    assert (plain / "eagle" / "layer.onnx.data").read_bytes() == (
        eagle_bundle / "eagle" / "layer.onnx.data"
    ).read_bytes()


def test_the_registry_ships_a_head_only_when_its_files_are_intact(eagle_bundle, tmp_path, monkeypatch):
    from edge_spec.export.eagle.attach import save_eagle_files, shipped_eagle_head
    from edge_spec.manifest import sha256_file
    from edge_spec.paths import load_registry

    saved = save_eagle_files(eagle_bundle, tmp_path / "saved")
    registry = load_registry()
    registry["models"]["tiny"] = {
        "eagle_head": {
            "dir": str(saved),
            "sha256": {name: sha256_file(saved / name) for name in ("layer.onnx.data", "eagle.json")},
        }
    }
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "registry.json").write_text(json.dumps(registry))
    monkeypatch.setenv("EDGE_SPEC_MODELS", str(tmp_path / "models"))
    assert shipped_eagle_head("tiny") == saved
    assert shipped_eagle_head("qwen2.5-coder-0.5b-instruct") is None  # the registry ships none for it
    (saved / "layer.onnx.data").write_bytes(b"damaged")
    with pytest.raises(EdgeSpecError, match="missing or damaged"):
        shipped_eagle_head("tiny")


def test_a_shipped_head_installs_into_another_quantization_of_the_same_model(eagle_bundle, tmp_path, tiny_pair):
    """The repository ships the trained head with its full LM head only; a user's export of the same
    model may quantize it otherwise (GGUF blocks carried), so its target bytes differ: the head still
    installs (same model: embedding rows within quantization noise) and stays exact."""
    from edge_spec.export.eagle.attach import install_eagle_files, save_eagle_files

    shipped = save_eagle_files(eagle_bundle, tmp_path / "shipped", heads=("full",))
    assert not any(p.name.startswith(("scorer_", "head_trim", "head_rows")) for p in shipped.iterdir())
    int8 = export_tiny(tmp_path / "int8", tiny_pair, quant="int8")
    install_eagle_files(int8, shipped)
    engine = Engine.from_bundle(int8, threads=1, config=loop_config("spec", drafter="eagle"), exact=True)
    assert greedy_matches_target_only(engine, eagle(2), n=16) > 0
    with pytest.raises(EdgeSpecError, match="no LM head"):
        save_eagle_files(eagle_bundle, tmp_path / "none", heads=("nonesuch",))


def test_the_repository_ships_a_head_for_the_default_target():
    """`edge-spec export` of the default pair attaches the head trained here (no training on a fresh
    clone): its files are in the repository, match the registry's sha256 and stay under 64 MB."""
    from edge_spec.export.eagle.attach import shipped_eagle_head
    from edge_spec.export.eagle.model import Eagle3Config
    from edge_spec.paths import default_pair

    directory = shipped_eagle_head(default_pair()[0])  # raises when a file is missing or damaged
    assert directory is not None
    record = json.loads((directory / "eagle.json").read_text())
    assert set(record["heads"]) == {"full"} and all((directory / name).is_file() for name in record["files"])
    assert sum(p.stat().st_size for p in directory.iterdir()) <= 64 << 20
    config = Eagle3Config.from_hf_config(record["config"])
    assert config.draft_vocab_size == record["heads"]["full"]["size"]


def test_a_call_in_another_mode_follows_and_reports_its_own_drafter(eagle_bundle):
    """An engine set up for the EAGLE head answering one call in ssd mode (which drafts with the drafter
    model): the drafter model's passes, not the head's, are the ones hooked for a cancel (and unhooked
    after), the prefill progress is the target's, and the answer's statistics price that drafter."""
    engine = Engine.from_bundle(eagle_bundle, threads=1, config=loop_config("spec", drafter="eagle"))
    bundle = engine.bundle
    bundle.target.prefill_chunk = 5
    bundle.drafter.body.prefill_chunk = 5
    fractions: list[float] = []
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 2
    got = engine.complete(prompt, max_new_tokens=6, mode="ssd", on_prefill=fractions.append)
    assert fractions and fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
    ssd = loop_config("ssd")
    assert got.stats.spec.param_ratio == pytest.approx(bundle.param_ratio(ssd))
    assert bundle.param_ratio(ssd) != pytest.approx(bundle.param_ratio(engine.config))
    assert bundle.drafter.decoder.prefill_listener is None and bundle.drafter.decoder.stop_requested is None
