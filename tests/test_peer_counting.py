"""The peers benchmark counts every engine's decode tokens alike, whatever the engine does with the EOS
(``edge_spec.benchmarking.peers``, the counting ``spec_peers.py`` and its workers share).

onnxruntime-genai leaves the EOS out of its sequence but takes one more ``generate_next_token`` call
for it; OpenVINO streams its first tokens in one write.  A tokens/s that counted calls would credit
one engine a token per finished answer, which on 3-15 token answers decides a category.
"""

from __future__ import annotations

import pytest

from edge_spec.benchmarking import peers

EOS = {151645}


def test_an_answer_counts_the_same_with_or_without_its_eos_in_the_sequence():
    with_eos = peers.result([11, 12, 13, 151645], EOS, 1, 0.2, 1.0)  # our engine, OpenVINO
    without_eos = peers.result([11, 12, 13], EOS, 1, 0.2, 1.0)  # onnxruntime-genai
    assert with_eos["ids"] == without_eos["ids"] == [11, 12, 13]
    assert with_eos["decode_tokens"] == without_eos["decode_tokens"] == 2


def test_tokens_known_at_the_first_write_are_not_decode_tokens():
    record = peers.result([1, 2, 3, 4, 5], EOS, 3, 0.1, 1.0)
    assert record["decode_tokens"] == 2


def test_old_records_are_recounted_from_the_answer(tmp_path):
    """A run saved with genai's per-call count is recounted; the report then ranks by the answer."""
    genai = {"engine": "genai ar", "category": "rag", "new_tokens": 3, "decode_tokens": 3, "decode_seconds": 0.2}
    ours = {"engine": "ours ar", "category": "rag", "new_tokens": 3, "decode_seconds": 0.2}
    openvino = {
        "engine": "openvino ar",
        "category": "rag",
        "new_tokens": 5,
        "decode_tokens": 3,
        "first_write_tokens": 2,
        "decode_seconds": 0.3,
    }
    assert [peers.decode_tokens(r) for r in (genai, ours, openvino)] == [2, 2, 3]
    saved = tmp_path / "peers.json"
    saved.write_text(__import__("json").dumps({"records": [genai, ours, openvino]}))
    table = peers.report(saved)
    rows = {
        line.split()[1] + " " + line.split()[2]: float(line.split()[4])
        for line in table.splitlines()
        if line.startswith("rag")
    }
    assert rows["genai ar"] == pytest.approx(10.0) and rows["ours ar"] == pytest.approx(10.0)
    assert rows["openvino ar"] == pytest.approx(10.0)


def test_a_file_that_is_not_a_run_gets_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a spec_peers result"):
        peers.report(bad)
