"""CLI behaviour: one clear error line for user mistakes, no traceback; generate and bench work end to end."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from edge_spec.bench import load_bench_prompts, modes_for, run_bench
from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.speculative import SpecConfig


def cli(*args: str, timeout: int = 300, input_text: str | None = None) -> subprocess.CompletedProcess:
    """Run the CLI in a subprocess (stdin: ``input_text``, else nothing)."""
    return subprocess.run([sys.executable, "-m", "edge_spec.cli", *args], capture_output=True, text=True,
                          timeout=timeout, input=input_text, stdin=None if input_text is not None else subprocess.DEVNULL)


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert fragment in lines[0], lines[0]


def test_missing_bundle(tmp_path):
    assert_one_line_error(cli("generate", str(tmp_path / "nope"), "hi"), "bundle not found")


def test_not_a_bundle(tmp_path):
    assert_one_line_error(cli("info", str(tmp_path)), "not an edge-spec bundle")


def test_corrupted_onnx(tmp_path, int4_bundle):
    broken = tmp_path / "broken"
    shutil.copytree(int4_bundle, broken)
    onnx_file = broken / "target" / "model.onnx"
    data = bytearray(onnx_file.read_bytes())
    data[10:400] = b"\xff" * 390
    onnx_file.write_bytes(bytes(data))
    assert_one_line_error(cli("generate", str(broken), "hi", "--mode", "ar"), "cannot load")


def test_truncated_weights_detected(tmp_path, int4_bundle):
    broken = tmp_path / "trunc"
    shutil.copytree(int4_bundle, broken)
    data_file = broken / "target" / "model.onnx.data"
    data_file.write_bytes(data_file.read_bytes()[:-100])
    assert_one_line_error(cli("generate", str(broken), "hi"), "corrupted")


def test_unknown_provider(int4_bundle):
    assert_one_line_error(cli("generate", str(int4_bundle), "hi", "--provider", "tpu"), "unknown provider")


def test_uninstalled_provider(int4_bundle):
    assert_one_line_error(cli("generate", str(int4_bundle), "hi", "--provider", "coreml"), "not installed")


def test_unknown_head(int4_bundle):
    assert_one_line_error(cli("generate", str(int4_bundle), "hi", "--draft-head", "trim-7"), "no drafter head")


def test_prompt_longer_than_context(int4_bundle):
    assert_one_line_error(cli("generate", str(int4_bundle), "word " * 400), "longer than the context")


def test_bad_flag_value(int4_bundle):
    result = cli("generate", str(int4_bundle), "hi", "--temperature", "-1")
    assert_one_line_error(result, "temperature")


def test_prompt_from_standard_input(int4_bundle):
    piped = cli("generate", str(int4_bundle), "-", "--max-tokens", "6", "--threads", "1", "--mode", "ar",
                input_text="def is_prime(n):\n")
    direct = cli("generate", str(int4_bundle), "def is_prime(n):\n", "--max-tokens", "6", "--threads", "1",
                 "--mode", "ar")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == direct.stdout and piped.stdout.strip()
    assert_one_line_error(cli("generate", str(int4_bundle), "-", input_text="  \n"), "standard input is empty")


def test_negative_threads(int4_bundle):
    assert_one_line_error(cli("generate", str(int4_bundle), "hi", "--threads", "-1"), "--threads must be 0")


@pytest.mark.parametrize("flags, fragment", [
    (["--repeat", "0"], "--repeat must be at least 1"),
    (["--sweep", "0,1"], "--sweep values must be at least 1"),
    (["--per-category", "0"], "--per-category must be at least 1"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--temperature", "-2"], "temperature"),
])
def test_bad_bench_flags_fail_before_loading(tmp_path, int4_bundle, flags, fragment):
    """Checked before the engine loads: a bundle whose target cannot load proves nothing was loaded."""
    broken = tmp_path / "broken"
    shutil.copytree(int4_bundle, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    (broken / manifest["target"]["onnx"]).unlink()
    assert_one_line_error(cli("bench", str(broken), *flags), fragment)


def test_missing_gguf_source(tmp_path):
    assert_one_line_error(cli("export", "--target", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "b")),
                          "not found")


def test_generate_and_info(int4_bundle):
    result = cli("generate", str(int4_bundle), "def is_prime", "--max-tokens", "8", "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stderr
    info = cli("info", str(int4_bundle))
    assert info.returncode == 0 and "trim-64" in info.stdout


def test_bench_records_identity_and_tau(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    prompts = load_bench_prompts(None, ["code", "multi-turn"], 1)
    result = run_bench(engine, prompts, modes_for(engine, None), temperatures=[0.0, 0.7], max_new_tokens=16,
                       spec=SpecConfig(gamma=3, adaptive=True))
    greedy_spec = [r for r in result["records"] if "tau" in r and r["temperature"] == 0.0]
    assert greedy_spec and all(r["identical_to_ar"] for r in greedy_spec)
    assert all(isinstance(r["identical_to_one_row_ar"], bool) for r in greedy_spec)
    # the batch-invariant reference is run for greedy answers only; the one-row ar is the speed baseline
    assert {r["temperature"] for r in result["records"] if r["mode"] == "ar-exact"} == {0.0}
    assert all(r["speedup_vs_ar"] == 1.0 for r in result["summary"] if r["mode"] == "ar")
    overall = [r for r in result["summary"] if r["category"] == "overall" and r["mode"] == "spec"]
    assert len(overall) == 2 and all(r["tau"] >= 1.0 for r in overall)
    json.dumps(result)  # serializable


def test_bad_multidraft_flags(int4_bundle):
    assert_one_line_error(cli("generate", str(int4_bundle), "hi", "--drafts", "2", "--verifier", "beam"),
                          "--verifier must be one of")
    assert_one_line_error(cli("generate", str(int4_bundle), "hi", "--drafts", "3", "--temperature", "0.7",
                              "--threads", "1"), "exactly 2 drafts")


def test_bench_multidraft_modes(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    prompts = load_bench_prompts(None, ["code"], 1)
    multidraft = [SpecConfig(gamma=2, drafts=2, scheme=s) for s in ("rrs", "spechub")]
    modes = modes_for(engine, ["full"], [2], multidraft)
    assert [m.name for m in modes] == ["ar", "ar-exact", "spec@γ2", "spec+k2-rrs@γ2", "spec+k2-spechub@γ2", "spec"]
    result = run_bench(engine, prompts, modes, temperatures=[0.0, 0.7], max_new_tokens=12,
                       spec=SpecConfig(gamma=2, adaptive=True))
    greedy = [r for r in result["records"] if "tau" in r and r["temperature"] == 0.0]
    assert len(greedy) == 4 and all(r["identical_to_ar"] for r in greedy)
    assert all(0.0 <= r["first_token_acceptance"] <= 1.0 for r in result["records"] if "tau" in r)


def test_generate_ssd_with_split_threads(int4_bundle):
    result = cli("generate", str(int4_bundle), "def is_prime", "--max-tokens", "8", "--mode", "ssd", "--threads", "1",
                 "--draft-threads", "1", "--gamma", "2")
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stderr
    assert_one_line_error(cli("generate", str(int4_bundle), "hi", "--mode", "ssd", "--draft-threads", "-2"),
                          "--draft-threads")


def test_bench_ssd_modes(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, draft_threads=1, mode="spec")
    modes = modes_for(engine, ["trim-160"], None, (), [SpecConfig(gamma=2)])
    assert [m.name for m in modes] == ["ar", "ar-exact", "spec+trim-160+ssd@γ2", "spec+trim-160"]
    result = run_bench(engine, load_bench_prompts(None, ["code"], 1), modes, temperatures=[0.0], max_new_tokens=12,
                       spec=SpecConfig(gamma=2))
    ssd = [r for r in result["records"] if r["mode"].endswith("ssd@γ2")]
    assert ssd and ssd[0]["identical_to_ar"] and 0.0 <= ssd[0]["cache_hit_rate"] <= 1.0


def test_bench_repeats_keep_one_record_per_prompt_and_mode(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    prompts = load_bench_prompts(None, ["code"], 1)
    modes = modes_for(engine, ["trim-64"], [1])
    result = run_bench(engine, prompts, modes, temperatures=[0.0], max_new_tokens=8, spec=SpecConfig(gamma=2),
                       repeats=2)
    assert sorted(r["mode"] for r in result["records"]) == sorted(m.name for m in modes)
    assert all(r["identical_to_ar"] for r in result["records"] if "tau" in r)
    with pytest.raises(EdgeSpecError, match="repeats"):
        run_bench(engine, prompts, modes, temperatures=[0.0], max_new_tokens=8, spec=SpecConfig(), repeats=0)


def test_cost_normalized_rates_price_every_pass_alike():
    from edge_spec.bench import cost_normalized_seconds, summarize

    # two runs of the same passes, the second slowed down by other load: one price per (decoder, rows)
    fast = {"category": "code", "temperature": 0.0, "mode": "ar", "new_tokens": 11, "decode_seconds": 1.05,
            "target_passes": {"1": [10, 1.0]}, "draft_passes": {}}
    slow = dict(fast, mode="spec@γ1", decode_seconds=1.55, target_passes={"1": [10, 1.5]}, tau=1.0,
                mbsu=1.0, mean_gamma=0.0, param_ratio=0.2, target_calls=10, acceptance_rate=0.0, head_seconds=0.0,
                draft_steps=0, candidate_recall=1.0, identical_to_ar=True, identical_to_one_row_ar=True)
    seconds = cost_normalized_seconds([fast, slow])
    assert seconds[id(fast)] == pytest.approx(1.25 + 0.05) and seconds[id(slow)] == pytest.approx(1.25 + 0.05)
    rows = {r["mode"]: r for r in summarize([fast, slow]) if r["category"] == "code"}
    assert rows["spec@γ1"]["speedup_vs_ar"] == pytest.approx(1.05 / 1.55)
    assert rows["spec@γ1"]["normalized_speedup_vs_ar"] == pytest.approx(1.0)
