"""The exporter streams the weights: a GGUF source is read tensor by tensor (the float values transformers'
GGUF loader gives), a graph's initializers go to its external-data file as they are made (the files
``onnx.save_model`` writes), and a bundle exported that way is byte for byte the bundle of the loader
that held the whole float32 model.  How much memory an export takes is measured in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package (the export extra) reads GGUF files")

from edge_spec.export.graph_builder import BuildOptions, build_decoder, save_model, write_model  # noqa: E402
from tests import gguf_models, tiny_models  # noqa: E402


def _llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.3,
        architectures=["LlamaForCausalLM"],
    )
    return LlamaForCausalLM(config).eval()


def _transformers_state(path: Path) -> tuple[object, dict[str, np.ndarray]]:
    """(config, float32 state dict) as transformers' GGUF loader gives them: the whole model at once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config.architectures = config.architectures or [type(model).__name__]
    return config, {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_tensors_read_one_at_a_time_are_what_transformers_loads(tmp_path, arch):
    """Every parameter, read alone from the file (Llama's q/k rows put back in transformers' order, mixed
    GGUF types), equals transformers' whole-model load bit for bit, and so does any band of its rows."""
    from edge_spec.export.gguf.tensors import GGUFTensors
    from edge_spec.export.weights import DeferredMatrix

    tokenizer = tiny_models.make_tokenizer()
    model = tiny_models.make_qwen2(seed=0) if arch == "qwen2" else _llama()
    kinds = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0", "ffn_down": "Q4_0", "token_embd": "Q8_0"}
    path = gguf_models.write_model_gguf(tmp_path / f"{arch}.gguf", model, tokenizer, arch, kinds)
    config, reference = _transformers_state(path)
    tensors = GGUFTensors(path, config)
    tied = [] if "lm_head.weight" in tensors else ["lm_head.weight"]  # transformers ties it to the embedding
    assert sorted(tensors) == sorted(set(reference) - set(tied))
    deferred = 0
    for name in tensors:
        value = tensors[name]
        np.testing.assert_array_equal(np.asarray(value), reference[name], err_msg=name)
        if isinstance(value, DeferredMatrix):
            deferred += 1
            np.testing.assert_array_equal(value.rows(3, 11), reference[name][3:11], err_msg=name)
            rows = np.array([0, 1, 2, 7, 9, value.shape[0] - 1])
            np.testing.assert_array_equal(value.take_rows(rows), reference[name][rows], err_msg=name)
    assert deferred == 7 * 2 + 1 + (arch == "llama")  # the matrices: per layer, the embedding, an untied head


def _carried_weights():
    """Tiny weights with GGUF blocks attached: an affine 4-bit matrix (a correction), an 8-bit head."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from edge_spec.export.gguf.blocks import carry_gguf

    model = tiny_models.make_qwen2(seed=3, hidden=64)
    weights = tiny_models.loaded("t", model, tiny_models.make_tokenizer()).weights
    o = weights.layers[0].o
    weights.carried["layers.0.o"] = carry_gguf(quants.quantize(o, T.Q4_1), "Q4_1", *o.shape)
    head = weights.lm_head
    weights.carried["lm_head"] = carry_gguf(quants.quantize(head, T.Q8_0), "Q8_0", *head.shape)
    return weights


@pytest.mark.parametrize(
    "options",
    [
        BuildOptions("int4", context_length=64, tree_attention=True, attention_pad=True),
        BuildOptions("int4", context_length=64, carry_narrow=True, emit_hidden=True),
        BuildOptions("int8", context_length=64, gguf_blocks=False, build_head=False),
        BuildOptions("fp32", context_length=64),
    ],
    ids=["target", "small-layout", "int8-body", "fp32"],
)
def test_a_graph_written_as_it_is_built_is_the_file_onnx_saves(tmp_path, options):
    """``write_model`` (each initializer to the data file as it is made) gives the graph and data files
    ``save_model`` of the whole model in memory gives, byte for byte."""
    weights = _carried_weights()
    saved, written = tmp_path / "saved", tmp_path / "written"
    saved.mkdir(), written.mkdir()
    save_model(build_decoder(weights, options), saved / "model.onnx")
    write_model(written / "model.onnx", lambda data: build_decoder(weights, options, data))
    assert _files(written) == _files(saved)
    assert (written / "model.onnx.data").stat().st_size > 10_000


def _whole_model_loader(source: str):
    """The exporter's loader as it was when it held the whole model: transformers dequantizes every GGUF
    tensor into a float32 state dict, and every carried matrix's blocks are attached up front."""
    from transformers import AutoTokenizer

    from edge_spec.export.gguf.carry import attach_gguf_blocks
    from edge_spec.export.gguf.tokenizer import fix_gguf_tokenizer
    from edge_spec.export.sources import LoadedModel, _eos_ids
    from edge_spec.export.weights import weights_from_state_dict

    path = Path(source)
    config, state = _transformers_state(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    fix_gguf_tokenizer(path, tokenizer, source)
    weights = weights_from_state_dict(config, state)
    report = attach_gguf_blocks(path, weights)
    return LoadedModel(path.stem, source, weights, tokenizer, _eos_ids(tokenizer, config, None), report)


def _small_pair(directory: Path) -> tuple[str, str]:
    """A target and a drafter GGUF of K-quant blocks (Q4_K, Q6_K), sharing the tiny tokenizer."""
    tokenizer = tiny_models.make_tokenizer()
    shape = dict(vocab_size=512, intermediate=512, heads=4, kv_heads=2)
    target = gguf_models.write_random_qwen2_gguf(directory / "t.gguf", tokenizer, hidden=256, layers=2, **shape)
    draft = gguf_models.write_random_qwen2_gguf(directory / "d.gguf", tokenizer, hidden=256, layers=1, seed=1, **shape)
    return str(target), str(draft)


def _files(bundle: Path) -> dict[str, bytes]:
    return {p.relative_to(bundle).as_posix(): p.read_bytes() for p in sorted(bundle.rglob("*")) if p.is_file()}


def test_a_streamed_gguf_export_is_the_whole_model_export(tmp_path):
    """The same GGUF pair exported through the streaming loader and through the whole-model loader gives
    the same bundle: every file byte for byte, the manifest but for its times (so a shipped calibration
    text, keyed by the target graph's bytes, still applies)."""
    from edge_spec.export.bundle import ExportOptions, export_bundle

    target, draft = _small_pair(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nWhat is 2 + 2?\n")
    options = ExportOptions(context_length=64, calibration=prompts, calibration_tokens=6, rank=(16,), candidates=(8,))
    streamed = export_bundle(target, draft, tmp_path / "streamed", options)
    whole = export_bundle(target, draft, tmp_path / "whole", options, loader=_whole_model_loader)
    for manifest in (streamed, whole):
        for key in ("created", "export_seconds"):
            manifest.pop(key)
    assert streamed == whole
    files = {name: _files(tmp_path / name) for name in ("streamed", "whole")}
    files["streamed"].pop("manifest.json"), files["whole"].pop("manifest.json")
    assert files["streamed"].keys() == files["whole"].keys() and "target/model.onnx.data" in files["whole"]
    assert [n for n in files["whole"] if files["streamed"][n] != files["whole"][n]] == []
    assert json.dumps(streamed["target"]["quantization"]["gguf_blocks"]["carried"]) == '{"Q4_K": 12, "Q6_K": 3}'


def test_a_large_matrix_is_checked_on_a_sample_of_its_rows(tmp_path, monkeypatch):
    """A GGUF matrix of more rows than are checked has those rows decoded and compared alone, and a
    difference on one of them still keeps the matrix from being carried."""
    from edge_spec.export.gguf import carry
    from edge_spec.export.sources import load_model

    monkeypatch.setattr(carry, "CHECKED_ROWS", 64)
    target, _ = _small_pair(tmp_path)
    model = load_model(target)
    assert model.gguf_carry.report.fallback == {}
    model = load_model(target)
    gate = np.asarray(model.weights.layers[0].gate)  # 512 rows: rows 0, 8, 16 ... are checked
    gate[8] += 1e-3
    model.weights.layers[0].gate = gate
    assert model.gguf_carry.report.fallback == {"layers.0.gate": "Q4_K: blocks differ from the loaded weight"}
    assert "layers.0.gate" not in model.weights.carried and "layers.0.up" in model.weights.carried


_EXPORT = """
import json, resource, sys
from pathlib import Path
from edge_spec.export.bundle import ExportOptions, export_bundle

target, draft, out, prompts = sys.argv[1:5]
options = ExportOptions(context_length=256, calibration=Path(prompts), calibration_tokens=8)
manifest = export_bundle(target, draft, Path(out), options)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
print(json.dumps({"peak": peak, "target_bytes": manifest["target"]["bytes"]}))
"""


def _export_peak(target: str, draft: str, out: Path, prompts: Path) -> dict:
    """Export in a process of its own; its peak resident memory and the exported target's size."""
    result = subprocess.run(
        [sys.executable, "-c", _EXPORT, target, draft, str(out), str(prompts)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_export_memory_grows_with_the_quantized_model_not_the_float_one(tmp_path):
    """Exporting a larger pair takes more memory than exporting a tiny one (the same code, imports and
    runtime) by at most 2.5 times the exported int4 target's size.  Holding the whole float32 target
    (four bytes a weight, about six times the int4 size here) or several copies of the quantized model
    breaks this budget."""
    tokenizer = tiny_models.make_tokenizer()
    mid = dict(vocab_size=32768, intermediate=2048, heads=12, kv_heads=2)
    target = gguf_models.write_random_qwen2_gguf(tmp_path / "t.gguf", tokenizer, hidden=768, layers=6, **mid)
    draft = dict(mid, intermediate=768, heads=4)
    draft = gguf_models.write_random_qwen2_gguf(tmp_path / "d.gguf", tokenizer, hidden=256, layers=2, seed=1, **draft)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nWhat is 2 + 2?\n")
    (tmp_path / "small").mkdir()
    small = _export_peak(*_small_pair(tmp_path / "small"), tmp_path / "small" / "bundle", prompts)
    large = _export_peak(str(target), str(draft), tmp_path / "large", prompts)
    growth, budget = large["peak"] - small["peak"], 2.5 * large["target_bytes"]
    mib = 1 << 20
    assert growth <= budget, (
        f"exporting the larger pair took {growth / mib:.0f} MiB more than the tiny pair "
        f"({large['peak'] / mib:.0f} MiB at its peak); the budget is {budget / mib:.0f} MiB, 2.5 times "
        f"the int4 target's {large['target_bytes'] / mib:.0f} MiB"
    )
