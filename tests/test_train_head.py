"""``edge-spec train-head`` on tiny models: target embedding rows, feature collection (contents,
resume after a kill), head training (learns, resumes bit for bit), the command end to end."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from edge_spec.export.graph.builder import MS_DOMAIN, make_model
from edge_spec.export.graph.quantize import quantize_blockwise
from edge_spec.runtime.model.embedding import TargetEmbedding, TargetLMHead
from edge_spec.train import features as head_data
from edge_spec.train import trainer as head_training
from tests import tiny_models
from tests.helpers import assert_one_line_error, cli, export_tiny

LAYERS = (0, 2, 3)
PROMPTS = [
    "What is 12 * 7?",
    "def is_prime(n):",
    "Translate to French: the brown fox",
    "Summarize: speculative decoding",
    "The quick brown fox",
    "Let's think step by step",
    "Write a function that returns n > 1",
    [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "the lazy dog"},
        {"role": "user", "content": "and the fox?"},
    ],
    "Translate to French: le renard brun",
    "What is 7 * 12? Think step by step.",
]
TEXTS = {
    "a.py": "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, n))\n" * 12,
    "b.txt": "The quick brown fox jumps over the lazy dog. Translate to French: le renard brun. " * 10,
    "c.md": "Summarize: speculative decoding drafts tokens with a small model and verifies them. " * 10,
    "sub/d.txt": "What is 12 * 7? Let's think step by step: 12 * 7 = 84. " * 10,
}
COLLECT = head_data.CollectOptions(answer_tokens=24, window=64, held_out_every=3)


@pytest.fixture(scope="module")
def tiny_target():
    tokenizer = tiny_models.make_tokenizer()
    # init 0.05: peaked enough that the target's choices carry signal a head can learn in a few seconds
    target = tiny_models.make_qwen2(seed=0, layers=4, init=0.05)
    return tokenizer, target, tiny_models.perturbed_copy(target, seed=1, noise=0.15)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tiny_target):
    return export_tiny(tmp_path_factory.mktemp("th") / "int4", tiny_target, quant="int4")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"category": "t", "prompt": p}) for p in PROMPTS) + "\n")
    for name, text in TEXTS.items():
        (root / "text" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "text" / name).write_text(text)
    return root


def run_collect(bundle, out, sources, **kwargs):
    return head_data.collect(
        bundle,
        out,
        prompts=sources / "prompts.jsonl",
        text_dirs=[sources / "text"],
        options=COLLECT,
        layers=LAYERS,
        **kwargs,
    )


@pytest.fixture(scope="module")
def collected(tmp_path_factory, bundle, sources):
    out = tmp_path_factory.mktemp("work")
    run_collect(bundle, out, sources)
    return out


def shards_by_key(out):
    progress = head_data.read_progress(out)
    result = {}
    for key, record in progress["items"].items():
        with np.load(out / head_data.SHARDS / record["shard"]) as data:
            result[key] = ({k: data[k] for k in data.files}, record["split"])
    return result


# -- target embedding ----------------------------------------------------------------------------


def test_embedding_rows_are_what_the_graph_gathers(bundle, tiny_target):
    path = bundle / "target" / "model.onnx"
    table = TargetEmbedding.from_onnx(path)
    model = onnx.load(str(path))  # with its weights: the reference runs the graph's own op on them
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    graph = helper.make_graph(
        [node],
        "gather",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"])],
        [helper.make_tensor_value_info("embeds", TensorProto.FLOAT, [1, "s", table.hidden_size])],
        [
            numpy_helper.from_array(init[node.input[0]], node.input[0]),
            numpy_helper.from_array(init[node.input[2]], node.input[2]),
        ],
    )
    session = ort.InferenceSession(make_model(graph).SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([0, 5, 383, 5, 17, 200], np.int64)
    expected = session.run(None, {"input_ids": ids[None]})[0][0]
    np.testing.assert_array_equal(table.rows(ids), expected)
    # and the int4 reconstruction of the model's own embedding, the whole table at once
    embed = tiny_target[1].model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(table.table(chunk=100), quantize_blockwise(embed, 4, 32).dequantize())
    assert node.domain == MS_DOMAIN and table.shape == embed.shape


def test_fp32_embedding_and_lm_head_rows(tmp_path, tiny_target):
    fp32 = export_tiny(tmp_path / "fp32", tiny_target, quant="fp32")
    path = fp32 / "target" / "model.onnx"
    model = tiny_target[1]
    ids = [3, 1, 300]
    np.testing.assert_array_equal(
        TargetEmbedding.from_onnx(path).rows(ids), model.model.embed_tokens.weight.detach().numpy()[ids]
    )
    np.testing.assert_array_equal(TargetLMHead.from_onnx(path).rows(ids), model.lm_head.weight.detach().numpy()[ids])


def test_lm_head_rows_give_the_graphs_logits(collected):
    """The teacher the trainer recomputes (hidden state x LM-head rows) is the target's logits."""
    from edge_spec.runtime.model.decoder import Decoder

    graph = collected / "target" / "model.onnx"
    decoder = Decoder(graph, capacity=64)
    ids = list(range(5, 25))
    out = decoder.forward(ids, len(ids))
    rows = TargetLMHead.from_onnx(graph).rows(np.arange(out["logits"].shape[1]))
    recomputed = out["hidden_states"] @ rows.T
    scale = np.abs(out["logits"]).max()
    np.testing.assert_allclose(recomputed, out["logits"], rtol=0, atol=0.02 * scale)  # int8 activations in the graph
    assert (recomputed.argmax(-1) == out["logits"].argmax(-1)).mean() >= 0.9


# -- collection ----------------------------------------------------------------------------------


def test_shards_hold_the_reference_forward(collected, bundle):
    from edge_spec.runtime.model.decoder import Decoder
    from edge_spec.runtime.text import TextTokenizer

    graph = collected / "target" / "model.onnx"
    reference = Decoder(graph, capacity=256)
    tokenizer = TextTokenizer(bundle)
    shards = shards_by_key(collected)
    chats = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in PROMPTS]
    prompts = {head_data.prompt_items([{"messages": m, "category": ""}], COLLECT)[0].key: m for m in chats}
    kinds = {"text": 0, "prompt": 0}
    for key, (arrays, _) in shards.items():
        n = len(arrays["tokens"])
        assert arrays["features"].shape == (n, 3 * 64) and arrays["features"].dtype == np.float16
        assert arrays["hidden"].shape == (n, 64) and arrays["labels"].dtype == np.int32
        if key.startswith("text:"):  # see test_text_shards_equal_one_pass
            kinds["text"] += 1
            continue
        kinds["prompt"] += 1
        prompt_ids = tokenizer.encode(tokenizer.render_chat(prompts[key]))
        fed = prompt_ids[:1] + arrays["tokens"].tolist()
        reference.reset()
        out = reference.forward(fed, len(fed))
        assert fed[: len(prompt_ids)] == prompt_ids
        np.testing.assert_allclose(
            arrays["features"].astype(np.float32),
            out["features"][:n],
            rtol=2e-2,
            atol=2e-2 * np.abs(out["features"]).max(),
        )
        labelled = arrays["labels"] >= 0
        assert labelled.sum() == n - (len(prompt_ids) - 1)  # answer rows, from the last prompt position on
        assert not labelled[: len(prompt_ids) - 1].any()
        greedy = out["logits"].argmax(-1)[1:]
        top2 = np.sort(out["logits"], axis=-1)[:, -2:]
        clear = labelled & (top2[1:, 1] - top2[1:, 0] > 0.01 * np.abs(out["logits"]).max())
        assert (arrays["labels"][clear] == greedy[clear]).all()
        # the generated answer continues the labels: label of row t is the token fed at t + 2
        answer = np.flatnonzero(labelled)
        assert (arrays["labels"][answer[:-1]] == arrays["tokens"][answer[1:]]).all()
    assert kinds["prompt"] == len(PROMPTS) and kinds["text"] > 0


def test_text_shards_equal_one_pass(collected, bundle, sources):
    from edge_spec.runtime.model.decoder import Decoder
    from edge_spec.runtime.text import TextTokenizer

    graph = collected / "target" / "model.onnx"
    reference = Decoder(graph, capacity=256)
    tokenizer = TextTokenizer(bundle)
    shards = shards_by_key(collected)
    items = head_data.text_items([sources / "text"], tokenizer, COLLECT)
    assert items and all(item.key in shards for item in items)
    for item in items:
        arrays, split = shards[item.key]
        assert (split == "held_out") == item.held_out
        reference.reset()
        out = reference.forward(item.ids, len(item.ids))
        np.testing.assert_array_equal(arrays["tokens"], item.ids[1:])
        np.testing.assert_array_equal(arrays["features"], out["features"][:-1].astype(np.float16))
        np.testing.assert_array_equal(arrays["labels"], out["logits"].argmax(-1)[1:])
        np.testing.assert_array_equal(arrays["hidden"], out["hidden_states"][1:].astype(np.float16))
    assert any(item.held_out for item in items) and not all(item.held_out for item in items)


def test_collection_resumes_after_a_kill(tmp_path, bundle, sources, collected, monkeypatch):
    out = tmp_path / "work"
    done = []

    def kill_after_three(report):
        done.append(report["item"])
        if len(done) == 3:
            raise KeyboardInterrupt  # as a Ctrl-C after the third item's progress was saved

    with pytest.raises(KeyboardInterrupt):
        run_collect(bundle, out, sources, report=kill_after_three)
    assert len(head_data.read_progress(out)["items"]) == 3
    # a kill between writing the fifth shard and recording it: the shard is there, progress is not
    saves = []
    real_save = head_data.Progress.save

    def save(self, out_dir):
        saves.append(1)
        if len(saves) == 2:
            raise KeyboardInterrupt
        real_save(self, out_dir)

    monkeypatch.setattr(head_data.Progress, "save", save)
    with pytest.raises(KeyboardInterrupt):
        run_collect(bundle, out, sources)
    monkeypatch.setattr(head_data.Progress, "save", real_save)
    assert len(head_data.read_progress(out)["items"]) == 4
    assert len(list((out / head_data.SHARDS).glob("*.npz"))) == 5  # one orphan
    result = run_collect(bundle, out, sources)
    assert result["pending"] == 0
    resumed, reference = shards_by_key(out), shards_by_key(collected)
    assert resumed.keys() == reference.keys()
    for key, (arrays, split) in reference.items():
        assert resumed[key][1] == split
        for name, value in arrays.items():
            np.testing.assert_array_equal(resumed[key][0][name], value, err_msg=f"{key} {name}")
    again = run_collect(bundle, out, sources)  # nothing left to do
    assert again["items"] == result["items"]


def test_changed_settings_are_refused(tmp_path, bundle, sources, collected):
    out = tmp_path / "copy"
    shutil.copytree(collected, out)
    from edge_spec.errors import EdgeSpecError

    with pytest.raises(EdgeSpecError, match="other settings"):
        head_data.collect(
            bundle,
            out,
            prompts=sources / "prompts.jsonl",
            options=head_data.CollectOptions(answer_tokens=12, window=64, held_out_every=3),
            layers=LAYERS,
        )


# -- training ------------------------------------------------------------------------------------

TRAIN = head_training.TrainOptions(
    draft_vocab=256, intermediate=128, steps=200, lr=5e-3, warmup=10, seed=0, eval_rows=100_000
)


def test_unrolled_first_step_is_the_heads_forward(collected, bundle):
    target = head_training.Target.from_work(bundle, collected)
    trainer = head_training.Trainer(collected, target, TRAIN)
    seq = trainer.data.train[0]
    embeds = trainer._embeds(seq, 3)
    steps = head_training.unrolled(trainer.head, seq.features.float(), embeds, 3)
    hidden = trainer.head.fuse(seq.features.float())[None]
    logits, _ = trainer.head(embeds[: len(seq.labels)][None], hidden)
    torch.testing.assert_close(steps[0], logits[0], rtol=0, atol=1e-5)
    assert [s.shape for s in steps] == [logits[0].shape] * 3
    # step 2 at row t reads only rows <= t of step 1 and its own diagonal: a later row changes nothing
    cut = len(seq.labels) // 2
    short = head_training.unrolled(trainer.head, seq.features[:cut].float(), embeds[: cut + 2], 3)
    for full, part in zip(steps, short):
        torch.testing.assert_close(full[:cut], part, rtol=1e-5, atol=1e-5)


def test_draft_vocabulary_maps(collected, bundle):
    target = head_training.Target.from_work(bundle, collected)
    trainer = head_training.Trainer(collected, target, TRAIN)
    head, ids = trainer.head, trainer.vocab_ids
    assert len(ids) == 256 and np.all(np.diff(ids) > 0)
    assert set(target.eos_ids) <= set(ids.tolist())
    np.testing.assert_array_equal(head.draft_to_target(np.arange(len(ids))), ids)
    assert head.t2d.sum() == len(ids) and head.t2d[torch.from_numpy(ids)].all()
    counts = trainer.data.label_counts
    assert counts[ids].sum() >= np.sort(counts)[::-1][: len(ids) - len(target.eos_ids)].sum()


@pytest.fixture(scope="module")
def trained(collected, bundle):
    target = head_training.Target.from_work(bundle, collected)
    work = collected.parent / "train-fresh"
    shutil.copytree(collected, work, ignore=shutil.ignore_patterns("train"))
    return work, head_training.train(work, target, TRAIN, threads=1)


def test_training_beats_the_untrained_head(trained):
    work, trainer = trained
    start, end = trainer.curve[0], trainer.curve[-1]
    assert start["step"] == 0 and end["step"] == TRAIN.steps
    assert end["loss"] < start["loss"] - 0.05
    assert end["acceptance_1"] > start["acceptance_1"] + 0.15
    assert end["acceptance_2"] > start["acceptance_2"]
    curve = json.loads((work / "train" / head_training.CURVE).read_text())
    assert curve["points"][-1]["acceptance_1"] == end["acceptance_1"] and curve["train_tokens"] > 0


def test_a_trained_head_drafts_for_the_runtime_and_output_stays_the_targets(tmp_path, trained, bundle):
    """The trained head, attached to the bundle, drafts through the chain loop: its drafts are accepted
    (the accept path runs, not only rejections) and greedy output equals target-only decoding."""
    from edge_spec.export.eagle.attach import attach_eagle_head
    from edge_spec.runtime.engine import Engine
    from edge_spec.runtime.loops.config import loop_config

    _, trainer = trained
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    attach_eagle_head(copy, trainer.config, trainer.head)
    for gamma in (1, 3):
        engine = Engine.from_bundle(
            copy, threads=1, config=loop_config("spec", drafter="eagle", gamma=gamma, schedule="fixed", lookup=False)
        )
        accepted = 0
        for prompt in PROMPTS[:6]:
            got = engine.complete(prompt, max_new_tokens=24)
            want = engine.complete(prompt, max_new_tokens=24, mode="ar", exact=True)
            assert got.token_ids == want.token_ids, (gamma, prompt)
            accepted += got.stats.spec.tally("eagle").accepted
        assert accepted > 0, f"γ={gamma}: no draft of the trained head was accepted"


def test_resumed_training_equals_uninterrupted(tmp_path, collected, bundle):
    options = head_training.TrainOptions(
        draft_vocab=128, intermediate=64, steps=8, accum=2, lr=3e-3, warmup=2, eval_rows=50
    )
    target = head_training.Target.from_work(bundle, collected)
    runs = {}
    for name in ("straight", "resumed"):
        work = tmp_path / name
        shutil.copytree(collected, work, ignore=shutil.ignore_patterns("train"))
        if name == "straight":
            trainer = head_training.train(work, target, options, threads=1)
        else:
            head_training.train(work, target, options, threads=1, stop_after=3)
            from edge_spec.errors import EdgeSpecError

            with pytest.raises(EdgeSpecError, match="--resume"):
                head_training.train(work, target, options, threads=1)
            trainer = head_training.train(work, target, options, threads=1, resume=True)
        runs[name] = trainer
    a, b = runs["straight"], runs["resumed"]
    assert a.step == b.step == 8
    for name, tensor in a.head.state_dict().items():
        assert torch.equal(tensor, b.head.state_dict()[name]), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for key in sa:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[key][name], sb[key][name])


# -- the command ---------------------------------------------------------------------------------


def test_train_head_command_end_to_end(tmp_path, bundle, sources):
    from edge_spec.export.eagle.model import load_specforge
    from edge_spec.manifest import read_manifest

    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    work = tmp_path / "work"
    args = [
        "train-head",
        str(copy),
        "--prompts",
        str(sources / "prompts.jsonl"),
        "--text",
        str(sources / "text"),
        "--max-tokens",
        "16",
        "--feature-layers",
        "0,2,3",
        "--vocab-size",
        "64",
        "--intermediate",
        "32",
        "--steps",
        "4",
        "--held-out-every",
        "3",
        "--max-items",
        "12",
        "--work",
        str(work),
        "--threads",
        "1",
    ]
    result = cli(*args)
    assert result.returncode == 0, result.stderr
    assert "attached the EAGLE-3 head" in result.stderr
    manifest = read_manifest(copy)
    assert manifest["eagle"]["draft_vocab_size"] == 64 and manifest["target"]["feature_layers"] == [0, 2, 3]
    config, head = load_specforge(work / "specforge")
    assert config.draft_vocab_size == 64 and config.feature_layers == (0, 2, 3)
    assert len(head_data.read_progress(work)["items"]) == 12
    # run again: collection has nothing left, training refuses to start over without --resume
    assert_one_line_error(cli(*args), "--resume")
    again = cli(*args, "--resume", "--no-attach")
    assert again.returncode == 0, again.stderr


def test_user_mistakes_are_one_line(tmp_path, bundle):
    assert_one_line_error(cli("train-head", str(tmp_path / "missing")), "bundle not found")
    assert_one_line_error(cli("train-head", str(bundle), "--collect-only", "--train-only"), "exclude")
    assert_one_line_error(
        cli(
            "train-head",
            str(bundle),
            "--text",
            str(tmp_path / "nope"),
            "--max-tokens",
            "16",
            "--feature-layers",
            "0,2,3",
            "--work",
            str(tmp_path / "w"),
        ),
        "not a directory",
    )
    assert_one_line_error(
        cli("train-head", str(bundle), "--train-only", "--work", str(tmp_path / "empty")), "no collected features"
    )


# -- a built head read back, and training from it ----------------------------------------------


@pytest.fixture(scope="module")
def saved_head(tmp_path_factory, trained, bundle):
    """The trained head built into a copy of the bundle (int4) and saved as the repository ships one."""
    from edge_spec.export.eagle.attach import attach_eagle_head, save_eagle_files

    _, trainer = trained
    root = tmp_path_factory.mktemp("saved")
    shutil.copytree(bundle, root / "bundle")
    attach_eagle_head(root / "bundle", trainer.config, trainer.head.eval())
    return root / "bundle", save_eagle_files(root / "bundle", root / "head", heads=("full",))


def test_a_saved_head_reads_back_as_the_int4_head_it_was_built_from(saved_head, trained, tmp_path):
    """Every weight comes back as the int4 graphs hold it (the layouts of q/k/v and gate/up included),
    from the saved directory and from the bundle alike; built again, the graphs are the same bytes."""
    from edge_spec.export.eagle.attach import attach_eagle_head
    from edge_spec.train.saved import load_head

    bundle_with_head, directory = saved_head
    _, trainer = trained
    original = trainer.head.state_dict()
    config, head = load_head(directory)
    assert config.feature_layers == trainer.config.feature_layers
    for name, tensor in head.state_dict().items():
        want = original[name].numpy()
        if name in ("d2t", "t2d") or want.ndim == 1:  # maps and norms are stored as they are
            np.testing.assert_array_equal(tensor.numpy(), want, err_msg=name)
        else:
            quantized = quantize_blockwise(want, 4, 32).dequantize()
            np.testing.assert_allclose(tensor.numpy(), quantized, rtol=0, atol=1e-6, err_msg=name)
            if name != "lm_head.weight":  # the frozen LM head is the int4 target's rows: int4 already
                assert not np.allclose(tensor.numpy(), want, atol=1e-6), f"{name}: not int4 (the control)"
    _, from_bundle = load_head(bundle_with_head)
    for name, tensor in from_bundle.state_dict().items():
        assert torch.equal(tensor, head.state_dict()[name]), name
    copy = tmp_path / "again"
    shutil.copytree(bundle_with_head, copy)
    attach_eagle_head(copy, config, head)
    for name in ("layer.onnx", "fc.onnx", "head_full.onnx"):
        for suffix in ("", ".data"):
            assert (copy / "eagle" / (name + suffix)).read_bytes() == (
                bundle_with_head / "eagle" / (name + suffix)
            ).read_bytes(), name + suffix


def test_training_from_a_saved_head_starts_where_it_stands(saved_head, trained, collected, bundle, tmp_path):
    """--init: the first evaluation is the saved head's (far above a fresh head's), its draft vocabulary
    is kept, and a few more steps do not undo it."""
    _, directory = saved_head
    _, fresh = trained
    work = tmp_path / "work"
    shutil.copytree(collected, work, ignore=shutil.ignore_patterns("train"))
    target = head_training.Target.from_work(bundle, collected)
    options = dataclasses.replace(TRAIN, steps=20, lr=1e-3, init=str(directory))
    trainer = head_training.train(work, target, options, threads=1)
    start, end = trainer.curve[0], trainer.curve[-1]
    assert start["acceptance_1"] > fresh.curve[0]["acceptance_1"] + 0.15
    assert abs(start["acceptance_1"] - fresh.curve[-1]["acceptance_1"]) < 0.05  # int4 moves a few argmaxes
    np.testing.assert_array_equal(trainer.vocab_ids, fresh.vocab_ids)
    assert end["loss"] < start["loss"] + 0.02


def test_an_init_for_other_features_is_one_line(saved_head, collected, bundle, tmp_path):
    _, directory = saved_head
    record = json.loads((directory / "eagle.json").read_text())
    record["config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    (other / "eagle.json").write_text(json.dumps(record))
    work = tmp_path / "work"
    shutil.copytree(collected, work, ignore=shutil.ignore_patterns("train"))
    target = head_training.Target.from_work(bundle, collected)
    from edge_spec.errors import EdgeSpecError

    with pytest.raises(EdgeSpecError, match="reads target layers"):
        head_training.train(work, target, dataclasses.replace(TRAIN, steps=2, init=str(other)), threads=1)
    assert_one_line_error(
        cli("train-head", str(bundle), "--train-only", "--work", str(work), "--init", str(tmp_path / "missing")),
        "not found",
    )
