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


def _record(category: str, engine: str, tokens_per_second: float) -> dict:
    """An answer of 65 tokens (64 decode tokens) decoded at ``tokens_per_second``."""
    return {
        "category": category,
        "engine": engine,
        "new_tokens": 65,
        "first_tokens": 1,
        "decode_seconds": 64 / tokens_per_second,
    }


def test_the_results_plot_pairs_our_default_with_each_categorys_fastest_peer(tmp_path):
    from edge_spec.benchmarking.peers_plot import fastest_peers, plot_peers

    records = [
        _record("code", "ours schedule+suffix", 25.0),
        _record("code", "ours ar", 14.0),
        _record("code", "genai ar", 17.0),
        _record("code", "openvino K8", 20.0),
        _record("qa", "ours schedule+suffix", 17.0),
        _record("qa", "ours ar", 14.0),
        _record("qa", "genai ar", 16.5),
        _record("qa", "openvino K8", 12.0),
    ]
    rows = fastest_peers(
        peers.summarize(records, list(dict.fromkeys(r["engine"] for r in records))), "ours schedule+suffix"
    )
    assert [(r[0], r[3]) for r in rows] == [
        ("code", "OpenVINO GenAI K=8"),
        ("qa", "onnxruntime-genai plain"),
        ("overall", "onnxruntime-genai plain"),
    ]
    assert rows[0][1:3] == pytest.approx((25.0, 14.0)) and rows[0][4] == pytest.approx(20.0)
    pytest.importorskip("matplotlib")
    path = tmp_path / "peers.png"
    assert plot_peers(records, path, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
