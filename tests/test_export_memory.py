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

from edge_spec.export.graph.builder import BuildOptions, build_decoder, save_model, write_model  # noqa: E402
from edge_spec.runtime.model.native_attention import native_matmul_here  # noqa: E402
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
    """(config, float32 state dict) as transformers loads a GGUF file or a directory: the whole model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    location, kwargs = (path, {}) if path.is_dir() else (path.parent, {"gguf_file": path.name})
    config = AutoConfig.from_pretrained(location, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **kwargs)
    config.architectures = config.architectures or [type(model).__name__]
    return config, {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_tensors_read_one_at_a_time_are_what_transformers_loads(tmp_path, arch):
    """Every parameter, read alone from the file (Llama's q/k rows put back in transformers' order, mixed
    GGUF types), equals transformers' whole-model load bit for bit, and so does any band of its rows."""
    from edge_spec.export.gguf.tensors import GGUFTensors
    from edge_spec.export.graph.weights import DeferredMatrix

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
    from edge_spec.export.graph.weights import weights_from_state_dict
    from edge_spec.export.sources.resolve import LoadedModel, _eos_ids

    path = Path(source)
    config, state = _transformers_state(path)
    weights = weights_from_state_dict(config, state)
    if path.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(path)
        return LoadedModel(path.name, source, weights, tokenizer, _eos_ids(tokenizer, config, None))
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    fix_gguf_tokenizer(path, tokenizer, source)
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


def _checkpoint_pair(directory: Path) -> tuple[str, str]:
    """The tiny pair as Hugging Face directories: the target in bfloat16 across several safetensors files,
    the drafter in float32 in one."""
    import torch

    tokenizer, target, draft = tiny_models.make_tokenizer(), tiny_models.make_qwen2(seed=0), None
    draft = tiny_models.perturbed_copy(target, seed=1, noise=0.15)
    for name, model, settings in (
        ("target", target.to(torch.bfloat16), {"max_shard_size": "40KB"}),
        ("draft", draft, {}),
    ):
        model.save_pretrained(directory / name, **settings)
        tokenizer.save_pretrained(directory / name)
    assert len(list((directory / "target").glob("*.safetensors"))) > 1
    return str(directory / "target"), str(directory / "draft")


def test_safetensors_read_one_at_a_time_are_what_transformers_loads(tmp_path):
    """A directory's parameters read from its safetensors files (bfloat16 widened, several shards) equal
    transformers' float32 load; files that do not name every parameter are left to transformers."""
    from transformers import AutoConfig

    from edge_spec.export.sources.checkpoint import streamable

    target, _ = _checkpoint_pair(tmp_path)
    config, reference = _transformers_state(Path(target))
    tensors, model_class = streamable(Path(target), AutoConfig.from_pretrained(target))
    assert model_class == "Qwen2ForCausalLM" and sorted(tensors) == sorted(set(reference) - {"lm_head.weight"})
    for name in tensors:
        np.testing.assert_array_equal(np.asarray(tensors[name]), reference[name], err_msg=name)
    np.testing.assert_array_equal(
        tensors["model.embed_tokens.weight"].rows(5, 9), reference["model.embed_tokens.weight"][5:9]
    )
    from safetensors.numpy import save_file

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text((Path(target) / "config.json").read_text())
    save_file({"transformer." + k: v for k, v in reference.items()}, renamed / "model.safetensors")
    assert streamable(renamed, config) is None


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_a_streamed_export_is_the_whole_model_export(tmp_path, kind):
    """The same pair (GGUF files, or Hugging Face directories) exported through the streaming loader and
    through transformers' whole-model load gives the same bundle: every file byte for byte, the manifest
    but for its times (so a shipped calibration text, keyed by the target graph's bytes, still applies)."""
    from edge_spec.export.bundle.build import ExportOptions, export_bundle

    target, draft = _small_pair(tmp_path) if kind == "gguf" else _checkpoint_pair(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nWhat is 2 + 2?\n")
    options = ExportOptions(context_length=64, calibration=prompts, calibration_tokens=6, rank=(16,), candidates=(8,))
    streamed = export_bundle(target, draft, tmp_path / "streamed", options)
    whole = export_bundle(target, draft, tmp_path / "whole", options, loader=_whole_model_loader)
    for manifest in (streamed, whole):
        for key in ("created", "export_seconds"):
            manifest.pop(key)
        for timings in ("one_row_ms", "far_ms"):  # as export_seconds
            manifest.get("native_kernels", {}).pop(timings, None)
    assert streamed == whole
    files = {name: _files(tmp_path / name) for name in ("streamed", "whole")}
    files["streamed"].pop("manifest.json"), files["whole"].pop("manifest.json")
    assert files["streamed"].keys() == files["whole"].keys() and "target/model.onnx.data" in files["whole"]
    assert [n for n in files["whole"] if files["streamed"][n] != files["whole"][n]] == []
    if kind == "gguf":
        carried = streamed["target"]["quantization"]["gguf_blocks"]["carried"]
        assert json.dumps(carried) == '{"Q4_K": 12, "Q6_K": 3}'


def test_a_large_matrix_is_checked_on_a_sample_of_its_rows(tmp_path, monkeypatch):
    """A GGUF matrix of more rows than are checked has those rows decoded and compared alone, and a
    difference on one of them still keeps the matrix from being carried."""
    from edge_spec.export.gguf import carry
    from edge_spec.export.sources.resolve import load_model

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
import json, sys
from pathlib import Path
from edge_spec.export.bundle.build import ExportOptions, export_bundle
from tests.peak_memory import peak_rss_bytes

target, draft, out, prompts = sys.argv[1:5]
options = ExportOptions(context_length=256, calibration=Path(prompts), calibration_tokens=8)
manifest = export_bundle(target, draft, Path(out), options)
print(json.dumps({"peak": peak_rss_bytes(), "target_bytes": manifest["target"]["bytes"]}))
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
    runtime) by at most 2.75 times the exported int4 target's size (the native layout's: GGUF's own blocks,
    the smallest of the layouts).  Holding the whole float32 target (four bytes a weight, about six times the
    int4 size here) or three copies of the quantized model breaks this budget."""
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
    growth, budget = large["peak"] - small["peak"], 2.75 * large["target_bytes"]
    mib = 1 << 20
    assert growth <= budget, (
        f"exporting the larger pair took {growth / mib:.0f} MiB more than the tiny pair "
        f"({large['peak'] / mib:.0f} MiB at its peak); the budget is {budget / mib:.0f} MiB, 2.75 times "
        f"the int4 target's {large['target_bytes'] / mib:.0f} MiB"
    )


def _export_cli(monkeypatch, capsys, target: str, draft: str, out: Path):
    from tests.test_reliability import _cli

    args = ("export", "--target", target, "--draft", draft, "--output", str(out), "--context-length", "64")
    return _cli(monkeypatch, capsys, *args, "--draft-vocab", "full", "--eagle", "none", "--no-measure")


def _error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith("- ")]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def test_an_export_that_cannot_fit_in_memory_is_refused_before_loading(monkeypatch, capsys, tmp_path):
    """Where the system has less memory available than the export needs, the export stops before it
    loads anything, in one line that says what, how much and what to close; nothing is written."""
    from edge_spec.export.bundle import stages
    from edge_spec.export.sources import resolve as sources

    target, draft = _small_pair(tmp_path)

    def never(*args, **kwargs):
        raise AssertionError("loaded a model the memory could not hold")

    monkeypatch.setattr(sources, "_load_model", never)
    monkeypatch.setattr(stages, "available_memory", lambda: 300_000_000)
    out = tmp_path / "out"
    code, _, err = _export_cli(monkeypatch, capsys, target, draft, out)
    line = _error_line(err)
    needs = stages.BASE_BYTES + stages.PER_BYTE["gguf"] * Path(target).stat().st_size
    assert code == 1 and line == (
        f"error: not enough memory for loading the target: it needs about {needs / 1e9:.1f} GB and 0.3 GB is "
        "available; close other programs (browsers, other models, IDEs) or export on a machine with more "
        "memory (nothing was written)"
    )
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "t.gguf"]


def test_running_out_of_memory_is_one_line(monkeypatch, capsys, tmp_path):
    """A MemoryError while a graph is built is said as the step that ran out, and what to close."""
    from edge_spec.export.bundle import build as bundle

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(bundle, "export_decoder", out_of_memory)
    out = tmp_path / "out"
    code, _, err = _export_cli(monkeypatch, capsys, *_small_pair(tmp_path), out)
    line = _error_line(err)
    assert code == 1 and line.startswith("error: ran out of memory during building the target graph after holding ")
    assert line.endswith(
        ": close other programs (browsers, other models, IDEs) or export on a machine with more memory "
        "(nothing was written)"
    )
    assert not out.exists()


def test_the_export_says_where_its_time_went(monkeypatch, capsys, tmp_path):
    """The export's last progress line gives its time, each step's, and its peak memory."""
    code, _, err = _export_cli(monkeypatch, capsys, *_small_pair(tmp_path), tmp_path / "out")
    summary = [line for line in err.splitlines() if line.startswith("- export took ")]
    assert code == 0 and len(summary) == 1, err
    steps = ["loading the target", "building the target graph", "checking the target"]
    steps += ["timing the native op's prefetches", "loading the drafter", "building the drafter body"]
    steps += ["building the drafter heads"]
    native = native_matmul_here()[0] is not None  # the target's blocks run on the native op: its passes are timed
    pattern = r"- export took \d+ s \(" + ", ".join(rf"{s} \d+ s" for s in steps if native or "timing" not in s)
    pattern += r"\); peak memory \d+\.\d GB"
    import re

    assert re.fullmatch(pattern, summary[0]), summary[0]


def test_a_gguf_source_is_parsed_once_for_its_weights_and_blocks(tmp_path, monkeypatch):
    """Loading a GGUF source, checking its blocks and building its graph parse the file's header once
    (a 151k-token vocabulary takes seconds to parse): the blocks are read through the loader's records."""
    from edge_spec.export.bundle.build import export_decoder
    from edge_spec.export.sources.resolve import load_model

    target, _ = _small_pair(tmp_path)
    parses = gguf_models.count_gguf_parses(monkeypatch)
    model = load_model(target)
    assert "Q4_K" in model.gguf_carry.summary()
    export_decoder(model, tmp_path / "bundle", "target", BuildOptions(context_length=64))
    assert len(parses) == 1


def test_bands_quantized_on_every_core_are_the_bytes_of_one_core(monkeypatch):
    """A fused projection of deferred parts is quantized a band at a time on several threads, each band read
    from its parts alone (never a whole part), and gives the bytes one thread gives for the whole array."""
    import threading

    from edge_spec.export.graph import parallel, quantize
    from edge_spec.export.graph.weights import DeferredMatrix, stacked

    monkeypatch.setattr(quantize, "MIN_BAND_BYTES", 16 * 96 * 4)  # 16-row bands: many of them
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal((rows, 96)).astype(np.float32) for rows in (200, 72, 72)]
    readers, first_reads = set(), []
    together = threading.Barrier(1)

    def deferred(array):
        def whole():
            raise AssertionError("a band read the whole matrix")

        def rows(a, b):
            readers.add(threading.current_thread().name)
            first_reads.append(a)
            if len(first_reads) <= together.parties:  # the first reads run at once, one per worker
                together.wait(timeout=30)
            return array[a:b].copy()

        return DeferredMatrix(array.shape, whole, rows)

    expected = quantize.quantize_blockwise(np.concatenate(parts), 4, 32)
    for workers in (1, 3):
        monkeypatch.setattr(parallel, "WORKERS", workers)
        readers.clear(), first_reads.clear()
        together = threading.Barrier(workers)
        got = quantize.quantize_blockwise(stacked([deferred(p) for p in parts]), 4, 32)
        np.testing.assert_array_equal(got.packed, expected.packed)
        np.testing.assert_array_equal(got.scales, expected.scales)
        assert len(readers) == workers, readers
