"""The peers benchmark counts every engine's decode tokens alike, whatever the engine does with the EOS
(``edge_spec.bench.peers``, the counting ``spec_peers.py`` and its workers share).

onnxruntime-genai leaves the EOS out of its sequence but takes one more ``generate_next_token`` call
for it; OpenVINO streams its first tokens in one write.  A tokens/s that counted calls would credit
one engine a token per finished answer, which on 3-15 token answers decides a category.
"""

from __future__ import annotations

import pytest

from edge_spec.bench import peers

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
    from edge_spec.bench.peers_plot import fastest_peers, plot_peers

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


def test_the_table_gives_every_engine_its_mean_time_to_first_token(tmp_path):
    """Ours records its first-token time as ``first_token_seconds`` (request to first token, the drafter's
    prefill included), a peer's worker as ``prefill_seconds``; both reach the table, in ms, per category."""
    records = [
        dict(_record("long", "ours schedule+suffix", 20.0), first_token_seconds=2.0),
        dict(_record("long", "ours schedule+suffix", 20.0), first_token_seconds=4.0),
        dict(_record("long", "llamacpp draft", 20.0), prefill_seconds=1.5),
        dict(_record("long", "llamacpp draft", 20.0), prefill_seconds=2.5),
        _record("long", "genai ar", 20.0),  # a run saved before either was kept: no time to show
    ]
    rows = peers.summarize(records, list(dict.fromkeys(r["engine"] for r in records)))
    ttft = {(r["category"], r["engine"]): r["first_token_ms"] for r in rows}
    assert ttft[("long", "ours schedule+suffix")] == pytest.approx(3000.0)
    assert ttft[("long", "llamacpp draft")] == pytest.approx(2000.0)
    assert ttft[("long", "genai ar")] is None
    saved = tmp_path / "peers.json"
    saved.write_text(__import__("json").dumps({"records": records}))
    lines = peers.report(saved).splitlines()
    assert lines[0].split()[-1] == "ms" and "TTFT" in lines[0]
    shown = {" ".join(line.split()[1:3]): line.split()[-1] for line in lines if line.startswith("long")}
    assert shown == {"ours schedule+suffix": "3000", "llamacpp draft": "2000", "genai ar": "-"}


def test_the_plot_names_llama_cpp_modes():
    from edge_spec.bench.peers import peer_label

    assert peer_label("llamacpp ar") == "llama.cpp plain"
    assert peer_label("llamacpp draft") == "llama.cpp draft"
    assert peer_label("llamacpp ngram-mod") == "llama.cpp ngram-mod"
    assert peer_label("genai K4") == "onnxruntime-genai K=4"


@pytest.fixture
def session_peers(monkeypatch):
    """``benchmarks/session_peers.py`` (and the ``spec_peers.py`` it imports), imported as the scripts import
    each other; nothing is built or started."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import session_peers

    return session_peers


def test_llama_cpp_modes_get_their_flags(session_peers):
    flags = session_peers.mode_flags
    assert flags("plain", 2, 3) == []
    draft = flags("draft", 2, 3)
    assert draft[draft.index("-md") + 1] == str(session_peers.DRAFT_GGUF)
    assert draft[draft.index("--spec-type") + 1] == "draft-simple"
    assert draft[draft.index("--spec-draft-n-max") + 1] == "3" and draft[draft.index("--spec-draft-n-min") + 1] == "0"
    assert draft[draft.index("-td") + 1] == draft[draft.index("-tbd") + 1] == "2"
    assert flags("ngram-mod", 2, 3) == ["--spec-type", "ngram-mod"]
    assert flags("ngram-mod", 2, 3, "--spec-ngram-mod-n-match '24'") == [
        *("--spec-type", "ngram-mod"),
        *("--spec-ngram-mod-n-match", "24"),
    ]
    with pytest.raises(ValueError, match="unknown llama.cpp mode"):
        flags("eagle", 2, 3)


def test_spec_peers_runs_llama_cpp_plain_draft_and_ngram_mod(session_peers):
    import spec_peers

    assert spec_peers.LLAMACPP_MODES == ("plain", "draft", "ngram-mod")
    assert set(spec_peers.LLAMACPP_MODES) <= set(session_peers.LLAMACPP_MODES)
    assert "llamacpp" in spec_peers.PEERS


class _LearningServer:
    """A stand-in ``llama-server`` whose answers draw on what it answered before, as ``ngram-mod``'s tables do:
    its answer to a prompt it has seen since it started is marked, and a restart forgets."""

    def __init__(self, session_peers, mode: str) -> None:
        self.mode, self.engine, self.seen, self.restarts = mode, f"llamacpp {mode}", set(), 0
        self.learns = session_peers.LlamaServer.learns.fget(self)

    def restart(self, warmup_ids) -> None:
        self.seen.clear()
        self.restarts += 1

    def run(self, ids, new_tokens, temperature, seed, eos) -> dict:
        drafted_from_itself = self.learns and tuple(ids) in self.seen
        self.seen.add(tuple(ids))
        return {"ids": [1, 2, 3], "new_tokens": 3, "decode_seconds": 0.5 if drafted_from_itself else 1.0}


def test_repeats_restart_the_llama_cpp_modes_that_learn_from_their_answers(session_peers):
    """A prompt's repeats are timed afresh in every llama.cpp mode: a mode whose n-gram tables learn from its
    answers is restarted before each repeat after the first, a plain server is left running."""
    import spec_peers

    servers = {mode: _LearningServer(session_peers, mode) for mode in ("plain", "ngram-mod", "ngram-cache")}
    assert [s.learns for s in servers.values()] == [False, True, True]
    speeds = []
    for repeat in range(3):
        runs = spec_peers.llamacpp_runs(servers, [5, 6, 7], repeat, 3, set(), [9])
        assert [r["mode"] for r in runs] == list(servers)
        assert all(r["identical_to_ar"] for r in runs[1:])
        speeds.append([r["tokens_per_second"] for r in runs])
    assert speeds[0] == speeds[1] == speeds[2] == [2.0, 2.0, 2.0]  # no repeat drafted from its own answer
    assert [s.restarts for s in servers.values()] == [0, 2, 2]


def _prompt_tokens_read(decoder) -> int:
    return sum(n * calls for n, calls in decoder.stats.prefill_calls.items())


def test_each_of_our_modes_reads_the_whole_prompt_and_is_compared_with_ar(session_peers, fp32_bundle):
    """``spec_peers.py`` times our modes one at a time on emptied caches: run together, every mode after
    the first would find the prompt in the KV cache, and its time to the first token would be a cache hit."""
    import argparse

    import spec_peers

    args = argparse.Namespace(
        bundle=fp32_bundle,
        threads=1,
        gamma=None,
        k=[2],
        our_k=None,
        lookup=False,
        suffix=True,
        ar_exact=True,
        eagle_head=None,
        new_tokens=6,
    )
    ours = spec_peers.Ours(args)
    try:
        item = {"category": "qa", "prompt": "Tell me about the sea and the ships on it."}
        prompt = len(ours.engine.prompt_ids([{"role": "user", "content": item["prompt"]}]))
        target, baseline = (
            _prompt_tokens_read(ours.engine.bundle.target),
            _prompt_tokens_read(ours.baseline.bundle.target),
        )
        drafter = _prompt_tokens_read(ours.engine.bundle.drafter.decoder)
        records = ours.run(item)
        engines = [r["engine"] for r in records]
        assert engines == [
            "ours ar",
            "ours ar-exact",
            "ours γ2",
            "ours γ2+suffix",
            "ours schedule",
            "ours schedule+suffix",
        ]
        speculative = len(engines) - 2
        assert _prompt_tokens_read(ours.baseline.bundle.target) - baseline == prompt
        assert _prompt_tokens_read(ours.engine.bundle.target) - target == (speculative + 1) * prompt  # ar-exact too
        assert _prompt_tokens_read(ours.engine.bundle.drafter.decoder) - drafter == speculative * prompt
        assert all(r["first_token_seconds"] > 0 for r in records)
        for record in records[2:]:  # greedy: equal to the exact target-only answer, the flags run_bench sets
            assert record["identical_to_ar"] is True and isinstance(record["identical_to_one_row_ar"], bool)
    finally:
        for engine in (ours.engine, ours.baseline):
            engine.close()


def test_the_session_tables_give_every_engine_its_mean_time_to_first_token(session_peers):
    """A session turn's first token waits for its prompt: each engine's mean over the turns is a column, for
    all turns and for the later ones (whose prompts the engines may partly have read already)."""
    records = [
        dict(_record("edit", "ours spec", 30.0), turn=0, prefill_seconds=4.0),
        dict(_record("edit", "ours spec", 30.0), turn=1, prefill_seconds=1.0),
        dict(_record("edit", "llamacpp ar", 20.0), turn=0, prefill_seconds=6.0),
        dict(_record("edit", "llamacpp ar", 20.0), turn=1, prefill_seconds=3.0),
    ]
    table = session_peers.tables(records)
    header = next(line for line in table.splitlines() if line.startswith("| engine"))
    assert header.rstrip(" |").endswith("TTFT ms")
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ours") or line.startswith("| llama")]
    ttft = [(cells[1].strip(), cells[-2].strip()) for cells in rows]
    assert ttft[:4] == [("ours spec", "2500"), ("llamacpp ar", "4500"), ("ours spec", "1000"), ("llamacpp ar", "3000")]
