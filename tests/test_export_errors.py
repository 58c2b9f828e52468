"""What export, add-heads and train-head say when the system refuses a write (a full disk, a read-only
or forbidden directory), and a target/drafter pair refused before anything is built: one line, exit
code 1, nothing left behind, the bundle that was there kept."""

from __future__ import annotations

import errno
import functools
import json
import shutil
from pathlib import Path

import pytest

from edge_spec.errors import EdgeSpecError
from tests import tiny_models
from tests.gguf_models import finish_gguf
from tests.test_reliability import _cli, _export, _models


def _one_line(code, err, *fragments):
    """Exit code 1 and one ``error:`` line, after the progress lines (``- ...``) of the steps that ran."""
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith("- ")]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error:"), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _refusing_writer(code: int):
    """``write_model`` on a full disk (the write names no file) or in a forbidden directory (it does)."""

    def write_model(path, build):
        Path(path).write_bytes(b"\0" * 1000)  # half a file, as a write cut short leaves it
        if code == errno.ENOSPC:
            raise OSError(code, "No space left on device")
        raise PermissionError(code, "Permission denied", str(path))

    return write_model


REASONS = {errno.ENOSPC: "no space left on device", errno.EACCES: "permission denied"}


@pytest.fixture
def in_memory(monkeypatch, tiny_pair):
    """export and add-heads through the CLI load the tiny models from memory."""
    from edge_spec.export.bundle import build as bundle

    loader = _models(tiny_pair).__getitem__
    monkeypatch.setattr(bundle, "export_bundle", functools.partial(bundle.export_bundle, loader=loader))
    monkeypatch.setattr(bundle, "add_draft_heads", functools.partial(bundle.add_draft_heads, loader=loader))
    return bundle


@pytest.mark.parametrize("code, existing", [(errno.ENOSPC, True), (errno.EACCES, True), (errno.ENOSPC, False)])
def test_export_on_a_refusing_disk_is_one_line_and_keeps_the_bundle(
    monkeypatch, capsys, tmp_path, tiny_pair, in_memory, code, existing
):
    from edge_spec.manifest import read_manifest, verify_files

    out = tmp_path / "bundle"
    if existing:
        _export(out, tiny_pair)
        before = (out / "manifest.json").read_text()
    monkeypatch.setattr(in_memory, "write_model", _refusing_writer(code))
    result = _cli(
        monkeypatch,
        capsys,
        "export",
        "--target",
        "tiny-target",
        "--draft",
        "tiny-draft",
        "--output",
        str(out),
        "--quant",
        "fp32",
        "--context-length",
        "64",
        "--eagle",
        "none",
    )
    kept = f"the existing bundle at {out} was kept" if existing else f"nothing was written to {out}"
    line = _one_line(result[0], result[2], REASONS[code], f"writing {out}", kept)
    assert ".partial" not in line  # the hidden staging directory is not what the user named
    assert sorted(p.name for p in tmp_path.iterdir()) == (["bundle"] if existing else [])
    if existing:
        assert (out / "manifest.json").read_text() == before
        verify_files(out, read_manifest(out), full_hash=True)


def test_add_heads_on_a_full_disk_is_one_line_and_keeps_the_bundle(
    monkeypatch, capsys, tmp_path, fp32_bundle, in_memory
):
    from edge_spec.manifest import read_manifest, verify_files

    copy = tmp_path / "bundle"
    shutil.copytree(fp32_bundle, copy)
    before = (copy / "manifest.json").read_text()
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("def f(x):\n")
    monkeypatch.setattr(in_memory, "write_model", _refusing_writer(errno.ENOSPC))
    code, _, err = _cli(
        monkeypatch,
        capsys,
        "add-heads",
        str(copy),
        "--draft",
        "tiny-draft",
        "--draft-vocab",
        "trim",
        "--keep",
        "64",
        "--calibration",
        str(calibration),
    )
    _one_line(code, err, "no space left on device", f"writing {copy}", f"the bundle at {copy} was kept as it was")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "calibration.txt"]
    assert (copy / "manifest.json").read_text() == before
    verify_files(copy, read_manifest(copy), full_hash=True)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EMFILE])
def test_any_other_system_error_is_one_line(monkeypatch, capsys, tmp_path, fp32_bundle, code):
    import os

    from edge_spec.train import features as head_data

    def collect(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(tmp_path / "work" / "shards" / "0.npz"))

    monkeypatch.setattr(head_data, "collect", collect)
    result = _cli(
        monkeypatch, capsys, "train-head", str(fp32_bundle), "--collect-only", "--work", str(tmp_path / "work")
    )
    _one_line(result[0], result[2], os.strerror(code).lower(), str(tmp_path / "work" / "shards" / "0.npz"))


# -- the target/drafter pair, checked before anything is built --------------------------------------


def _hf_directory(path: Path, model, tokenizer) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("watched", [False, True], ids=["in-process", "watched"])
@pytest.mark.parametrize(
    "mismatch, fragment",
    [
        ("tokenizer", "drafter tokenizer differs from the target's"),
        ("vocabulary", "drafter vocabulary size 400 differs from the target's 384"),
    ],
)
def test_export_refuses_a_pair_before_building_anything(
    monkeypatch, capsys, tmp_path, tiny_pair, mismatch, fragment, watched
):
    """Watched (the console script): refused by the command itself, before it starts the process that
    does the work (a second interpreter's start would double the refusal's time)."""
    from edge_spec import paths
    from edge_spec.cli import export as export_command
    from edge_spec.export.bundle import build as bundle
    from edge_spec.export.bundle import watchdog
    from edge_spec.export.sources import resolve as sources

    tokenizer, target, draft = tiny_pair
    if mismatch == "tokenizer":
        other = tiny_models.make_tokenizer(specials=["<|endoftext|>", "<|im_end|>", "<|im_start|>"])
        target_dir = _hf_directory(tmp_path / "target", target, other)
    else:
        target_dir = _hf_directory(tmp_path / "target", target, tokenizer)
        draft = tiny_models.make_qwen2(seed=2, vocab_size=400)
    draft_dir = _hf_directory(tmp_path / "draft", draft, tokenizer)
    monkeypatch.setattr(paths, "default_pair", lambda: ("unused", draft_dir))  # the default drafter

    def never(*args, **kwargs):
        raise AssertionError("built or loaded a model before checking the pair")

    monkeypatch.setattr(sources, "_load_model", never)
    monkeypatch.setattr(bundle, "export_decoder", never)
    monkeypatch.setattr(export_command, "_watched", lambda: watched)
    monkeypatch.setattr(watchdog, "run", never)
    out = tmp_path / "out"
    code, _, err = _cli(monkeypatch, capsys, "export", "--target", target_dir, "--output", str(out), "--eagle", "none")
    _one_line(code, err, fragment)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["draft", "target"]
    assert json.loads((Path(draft_dir) / "config.json").read_text())  # the sources are untouched


def _tiny_gguf(path: Path, tokens: list[str], merges: tuple[str, ...] = ("a b", "ab c")) -> str:
    """A GGUF file with some metadata before and after its token list, and one tensor."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_string("general.note", "metadata before the tokens")
    writer.add_array("general.numbers", [1, 2, 3])
    writer.add_array("general.words", ["a", "bc"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(list(merges))
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    finish_gguf(writer)
    return str(path)


def test_gguf_pairs_are_checked_from_their_headers(monkeypatch, capsys, tmp_path):
    import gguf

    from edge_spec.export.bundle import build as bundle
    from edge_spec.export.sources import resolve as sources
    from edge_spec.export.sources.pair import check_pair, gguf_tokens, probe_pair

    words = [f"tok{i}" for i in range(40)]
    target = _tiny_gguf(tmp_path / "target.gguf", words)
    same = _tiny_gguf(tmp_path / "same.gguf", words)
    other = _tiny_gguf(tmp_path / "other.gguf", words[:5] + ["different"] + words[6:])
    assert gguf_tokens(Path(target)) == list(gguf.GGUFReader(target).fields["tokenizer.ggml.tokens"].contents())

    def never(*args, **kwargs):
        raise AssertionError("parsed, converted or built more than the header")

    with monkeypatch.context() as patched:
        patched.setattr(gguf, "GGUFReader", never)  # the whole-file parse is the slow part of a load
        check_pair(*probe_pair(target, same))
        with pytest.raises(EdgeSpecError, match="at token id 5"):
            check_pair(*probe_pair(target, other))
    monkeypatch.setattr(sources, "_load_model", never)
    monkeypatch.setattr(bundle, "export_decoder", never)
    code, _, err = _cli(
        monkeypatch,
        capsys,
        "export",
        "--target",
        target,
        "--draft",
        other,
        "--output",
        str(tmp_path / "out"),
        "--eagle",
        "none",
    )
    _one_line(
        code, err, "drafter tokenizer differs from the target's at token id 5 (target 'tok5' vs drafter 'different')"
    )
    assert not (tmp_path / "out").exists()


def _hf_tokenizer_directory(path: Path, tokenizer) -> str:
    """A Hugging Face directory holding a config and a tokenizer: all the pair check reads of a target."""
    target = tiny_models.make_qwen2(seed=0)
    target.config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _foreign(size: int) -> tuple[list[str], tuple[str, ...]]:
    """Tokens and merges of another vocabulary of ``size`` tokens (one transformers can convert)."""
    return ["x", "y", "xy", "z", "xyz", *(f"tok{i}" for i in range(5, size))], ("x y", "xy z")


def _vocab_list(tokenizer) -> list[str]:
    by_id = {i: text for text, i in tokenizer.get_vocab().items()}
    return [by_id[i] for i in range(len(by_id))]


@pytest.fixture
def parsed(monkeypatch):
    """The GGUF files parsed whole (gguf.GGUFReader: every field of the header, the slow part of a
    conversion through transformers), recorded."""
    import gguf

    seen = []
    original = gguf.GGUFReader

    def recording(path, *args, **kwargs):
        seen.append(Path(path).name)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", recording)
    return seen


def test_a_drafter_of_another_family_beside_a_hf_target_is_refused_from_its_header(tmp_path, parsed):
    """A Hugging Face target and a GGUF drafter whose token lists differ at most ids: refused from the
    GGUF header's token list, without parsing or converting the whole file (a 151k-token vocabulary takes
    a minute and a gigabyte that way)."""
    from edge_spec.export.sources.pair import check_pair, probe_pair

    tokenizer = tiny_models.make_tokenizer()
    target = _hf_tokenizer_directory(tmp_path / "target", tokenizer)
    other = _tiny_gguf(tmp_path / "other.gguf", *_foreign(len(tokenizer.get_vocab())))
    with pytest.raises(EdgeSpecError, match=r"drafter tokenizer differs from the target's at token id 0"):
        check_pair(*probe_pair(target, other))
    assert parsed == []


def test_a_drafter_whose_header_lists_the_targets_vocabulary_needs_no_conversion(tmp_path, parsed):
    from edge_spec.export.sources.pair import check_pair, probe_pair

    tokenizer = tiny_models.make_tokenizer()
    target = _hf_tokenizer_directory(tmp_path / "target", tokenizer)
    same = _tiny_gguf(tmp_path / "same.gguf", _vocab_list(tokenizer), ("Ġ d", "Ġ t"))
    check_pair(*probe_pair(target, same))
    assert parsed == []


def test_a_drafter_close_to_the_target_is_compared_in_the_targets_words(tmp_path, monkeypatch):
    """Token lists that differ at a few ids only may be one vocabulary written two ways (transformers
    rewrites some GGUF tokens, Gemma's tab and space runs): those are compared as transformers reads
    the GGUF file, as before."""
    from edge_spec.export.sources import pair

    tokenizer = tiny_models.make_tokenizer()
    target = _hf_tokenizer_directory(tmp_path / "target", tokenizer)
    tokens = _vocab_list(tokenizer)
    close = _tiny_gguf(tmp_path / "close.gguf", tokens[:7] + ["written otherwise"] + tokens[8:])
    converted = []
    original = pair.probe_model

    def probe(source, *, from_files=True):
        if not from_files:
            converted.append(source)
            return pair.ModelCard(source, tokenizer, None)  # transformers' reading, standing in
        return original(source, from_files=from_files)

    monkeypatch.setattr(pair, "probe_model", probe)
    pair.check_pair(*pair.probe_pair(target, close))
    assert sorted(converted) == sorted([target, close])  # both in transformers' words


def test_export_without_draft_refuses_a_default_drafter_of_another_family_at_once(
    monkeypatch, capsys, tmp_path, parsed
):
    """``export --target DIR`` pairs DIR with the registry's default drafter, a fetched GGUF file: one
    of another family is refused from its header, without parsing the file or reading either source
    through transformers (importing it alone takes seconds)."""
    import hashlib

    import transformers

    from edge_spec import paths
    from edge_spec.export.bundle import build as bundle
    from edge_spec.export.sources import resolve as sources

    tokenizer = tiny_models.make_tokenizer()
    target = _hf_tokenizer_directory(tmp_path / "target", tokenizer)
    models = tmp_path / "models"
    (models / "gguf").mkdir(parents=True)
    gguf_file = Path(_tiny_gguf(models / "gguf" / "draft.gguf", *_foreign(len(tokenizer.get_vocab()))))
    data = gguf_file.read_bytes()
    record = {"file": gguf_file.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    registry = {"models": {"tiny-draft": {"gguf": {**record, "pypi_parts": ["tiny-draft-part1"]}}}}
    (models / "registry.json").write_text(json.dumps(registry))
    monkeypatch.setenv("EDGE_SPEC_MODELS", str(models))
    monkeypatch.setattr(paths, "default_pair", lambda: ("unused", "tiny-draft"))

    def never(*args, **kwargs):
        raise AssertionError("read a source through transformers, or built or loaded a model")

    for auto in (transformers.AutoConfig, transformers.AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", never)
    monkeypatch.setattr(sources, "_load_model", never)
    monkeypatch.setattr(bundle, "export_decoder", never)
    out = tmp_path / "out"
    code, _, err = _cli(monkeypatch, capsys, "export", "--target", target, "--output", str(out), "--eagle", "none")
    _one_line(code, err, "drafter tokenizer differs from the target's at token id 0")
    assert parsed == [] and not out.exists()
