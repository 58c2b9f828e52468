"""A GGUF header parsed by the fast reader is gguf's own parse: the same fields, parts, dtypes and values,
and the same tensors; inside ``gguf_parsed_once`` transformers' conversion of a header is done once a file
and each caller gets a copy of its own."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package (the export extra) reads GGUF files")

import gguf  # noqa: E402

from edge_spec.export.gguf.header import FastParsing, parsed_once  # noqa: E402
from tests.gguf_models import finish_gguf  # noqa: E402


def _header_file(path, tokens):
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_string("general.note", "before the tokens: ünïcode ✓")
    writer.add_array("general.numbers", [1, 2, 3])
    writer.add_array("general.floats", [0.5, -1.25])
    writer.add_array("general.empty_words", [])
    writer.add_bool("general.flag", True)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["a b", "ab c", ""])
    writer.add_token_scores([float(i) for i in range(len(tokens))])
    writer.add_float32("general.after", 3.5)
    writer.add_tensor("token_embd.weight", np.arange(len(tokens) * 8, dtype=np.float32).reshape(len(tokens), 8))
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    finish_gguf(writer)
    return path


def _described(reader) -> tuple:
    fields = [
        (name, field.offset, field.types, field.data, [(part.dtype.str, part.tobytes()) for part in field.parts])
        for name, field in reader.fields.items()
    ]
    tensors = [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.data.tobytes()) for t in reader.tensors]
    return fields, tensors, reader.data_offset, reader.alignment


def test_the_fast_reader_parses_what_gguf_parses(tmp_path):
    tokens = ["", "a", "ab", "<|im_start|>", "é" * 40, " " * 3] + [f"tok{i}" for i in range(500)]
    path = _header_file(tmp_path / "h.gguf", tokens)
    fast = type("Fast", (FastParsing, gguf.GGUFReader), {})(path)
    assert _described(fast) == _described(gguf.GGUFReader(path))
    assert [
        bytes(fast.fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fast.fields["tokenizer.ggml.tokens"].data
    ] == tokens


def test_a_header_is_converted_once_a_file_and_each_caller_owns_its_copy(tmp_path, monkeypatch):
    from transformers import configuration_utils
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    path = str(_header_file(tmp_path / "h.gguf", [f"tok{i}" for i in range(64)]))
    plain = gguf_utils.load_gguf_checkpoint(path)
    conversions = []
    original = gguf_utils.load_gguf_checkpoint

    def counted(*args, **kwargs):
        conversions.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counted)
    monkeypatch.setattr(configuration_utils, "load_gguf_checkpoint", counted)
    with parsed_once():
        first = configuration_utils.load_gguf_checkpoint(path, return_tensors=False)
        first["tokenizer"]["tokens"].append("changed by its caller")
        first["config"].clear()
        second = gguf_utils.load_gguf_checkpoint(path)
    assert first is not second and second == plain and len(conversions) == 1
    assert gguf_utils.load_gguf_checkpoint is counted and configuration_utils.load_gguf_checkpoint is counted
