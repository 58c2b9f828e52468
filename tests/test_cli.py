"""CLI behaviour: one clear error line for user mistakes, no traceback; generate and bench work end to end.
The tests that run the CLI in a subprocess are marked ``slow``."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from edge_spec.bench.runs import BenchMode, load_bench_prompts, modes_for, per_prompt_schedule, run_bench
from edge_spec.errors import EdgeSpecError
from edge_spec.runtime.engine import Engine
from edge_spec.runtime.loops.config import SsdConfig, TreeConfig
from tests.helpers import assert_one_line_error, chain, cli


@pytest.mark.slow
def test_missing_bundle(tmp_path):
    assert_one_line_error(cli("generate", str(tmp_path / "nope"), "hi"), "bundle not found")


@pytest.mark.slow
def test_not_a_bundle(tmp_path):
    assert_one_line_error(cli("info", str(tmp_path)), "not an edge-spec bundle")


@pytest.mark.slow
def test_corrupted_onnx(tmp_path, int4_bundle):
    broken = tmp_path / "broken"
    shutil.copytree(int4_bundle, broken)
    onnx_file = broken / "target" / "model.onnx"
    data = bytearray(onnx_file.read_bytes())
    data[10:400] = b"\xff" * 390
    onnx_file.write_bytes(bytes(data))
    assert_one_line_error(cli("generate", str(broken), "hi", "--mode", "ar"), "cannot load")


@pytest.mark.slow
def test_truncated_weights_detected(tmp_path, int4_bundle):
    broken = tmp_path / "trunc"
    shutil.copytree(int4_bundle, broken)
    data_file = broken / "target" / "model.onnx.data"
    data_file.write_bytes(data_file.read_bytes()[:-100])
    assert_one_line_error(cli("generate", str(broken), "hi"), "corrupted")


@pytest.mark.slow
def test_unknown_provider(int4_bundle):
    assert_one_line_error(cli("generate", str(int4_bundle), "hi", "--provider", "tpu"), "unknown provider")


@pytest.mark.slow
def test_uninstalled_provider(int4_bundle):
    assert_one_line_error(cli("generate", str(int4_bundle), "hi", "--provider", "coreml"), "not installed")


@pytest.mark.slow
def test_unknown_head(int4_bundle):
    assert_one_line_error(cli("generate", str(int4_bundle), "hi", "--draft-head", "trim-7"), "no drafter head")


@pytest.mark.slow
def test_prompt_longer_than_context(int4_bundle):
    assert_one_line_error(cli("generate", str(int4_bundle), "word " * 400), "longer than the context")


@pytest.mark.slow
def test_bad_flag_value(int4_bundle):
    result = cli("generate", str(int4_bundle), "hi", "--temperature", "-1")
    assert_one_line_error(result, "temperature")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("generate", "BUNDLE", "hi", "--frobnicate"), "No such option: --frobnicate; see edge-spec generate --help"),
        (("info", "BUNDLE", "--costs", "--head", "full"), "No such option: --head (Possible options: --draft-head"),
        (("generate", "BUNDLE", "hi", "--temperature", "warm"), "Invalid value for '--temperature'"),
        (("generate",), "Missing argument '[BUNDLE] PROMPT'; see edge-spec generate --help"),
    ],
)
def test_a_mistyped_flag_or_argument_is_one_line_too(int4_bundle, args, fragment):
    """Click draws a usage box around these; the CLI says them in one line, with the help to read."""
    result = cli(*(str(int4_bundle) if a == "BUNDLE" else a for a in args))
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr


@pytest.mark.slow
def test_prompt_from_standard_input(int4_bundle):
    piped = cli(
        "generate",
        str(int4_bundle),
        "-",
        "--max-tokens",
        "6",
        "--threads",
        "1",
        "--mode",
        "ar",
        input_text="def is_prime(n):\n",
    )
    direct = cli(
        "generate", str(int4_bundle), "def is_prime(n):\n", "--max-tokens", "6", "--threads", "1", "--mode", "ar"
    )
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == direct.stdout and piped.stdout.strip()
    assert_one_line_error(cli("generate", str(int4_bundle), "-", input_text="  \n"), "standard input is empty")


@pytest.mark.slow
def test_negative_threads(int4_bundle):
    assert_one_line_error(cli("generate", str(int4_bundle), "hi", "--threads", "-1"), "--threads must be 0")


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--repeat", "0"], "--repeat must be at least 1"),
        (["--sweep", "0,1"], "--sweep values must be at least 1"),
        (["--per-category", "0"], "--per-category must be at least 1"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--temperature", "-2"], "temperature"),
        (["--modes", "ar,medusa"], "--modes: unknown mode 'medusa'; choose from ar, ar-exact, spec"),
        (["--eagle-head", "full"], "--eagle-head applies to --modes eagle"),
    ],
)
def test_bad_bench_flags_fail_before_loading(tmp_path, int4_bundle, flags, fragment):
    """Checked before the engine loads: a bundle whose target cannot load proves nothing was loaded."""
    broken = tmp_path / "broken"
    shutil.copytree(int4_bundle, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    (broken / manifest["target"]["onnx"]).unlink()
    assert_one_line_error(cli("bench", str(broken), *flags), fragment)


@pytest.mark.slow
def test_missing_gguf_source(tmp_path):
    assert_one_line_error(
        cli("export", "--target", str(tmp_path / "missing.gguf"), "--output", str(tmp_path / "b")), "not found"
    )


@pytest.mark.slow
def test_generate_and_info(int4_bundle):
    result = cli("generate", str(int4_bundle), "def is_prime", "--max-tokens", "8", "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stderr
    info = cli("info", str(int4_bundle))
    assert info.returncode == 0 and "trim-64" in info.stdout
    costs = cli("info", str(int4_bundle), "--costs", "--gamma", "3", "--threads", "1")
    assert costs.returncode == 0, costs.stderr
    rows = [line for line in costs.stdout.splitlines() if "target pass," in line]
    assert len(rows) == 4 and "drafter step" in costs.stdout and "planned drafts by acceptance" in costs.stdout
    assert "exact greedy passes: " in costs.stdout  # how many rows exactness costs on this device, and why
    assert_one_line_error(cli("info", str(int4_bundle), "--costs", "--draft-head", "nope"), "no drafter head 'nope'")


def decode_rate(records: list[dict]) -> float:
    """Tokens after the first (which comes out of the prefill pass) per decode second, pooled over records."""
    return sum(r["new_tokens"] - 1 for r in records) / sum(r["decode_seconds"] for r in records)


def test_bench_records_identity_and_tau(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(3, adaptive=True))
    prompts = load_bench_prompts(None, ["code", "multi-turn"], 1)
    max_new = 16
    result = run_bench(
        engine, prompts, modes_for(engine, None, engine.config), temperatures=[0.0, 0.7], max_new_tokens=max_new
    )
    records = result["records"]
    greedy_spec = [r for r in records if "tau" in r and r["temperature"] == 0.0]
    assert greedy_spec and all(r["identical_to_ar"] for r in greedy_spec)
    assert all(isinstance(r["identical_to_one_row_ar"], bool) for r in greedy_spec)
    # the batch-invariant reference is run for greedy answers only; the one-row ar is the speed baseline
    assert {r["temperature"] for r in records if r["mode"] == "ar-exact"} == {0.0}
    # every row's speed-up is its decode rate over the one-row ar's in the same temperature and category
    for row in result["summary"]:
        group = [
            r
            for r in records
            if r["temperature"] == row["temperature"] and row["category"] in ("overall", r["category"])
        ]
        own, ar = [r for r in group if r["mode"] == row["mode"]], [r for r in group if r["mode"] == "ar"]
        assert row["speedup_vs_ar"] == pytest.approx(decode_rate(own) / decode_rate(ar)), row
    # τ is tokens per target call: a speculative answer that ran to max_new decoded new_tokens - 1 tokens after
    # the prefill's one in its target calls; one that stopped at eos decoded at least new_tokens (eos among them)
    for r in (r for r in records if "tau" in r):
        decoded = r["tau"] * r["target_calls"]
        assert decoded == pytest.approx(max_new - 1) if r["new_tokens"] == max_new else decoded >= r["new_tokens"], r
    overall = {r["temperature"]: r for r in result["summary"] if r["category"] == "overall" and r["mode"] == "spec"}
    assert set(overall) == {0.0, 0.7}
    greedy = [r for r in greedy_spec if r["mode"] == "spec"]
    assert all(r["new_tokens"] == max_new for r in greedy)  # greedy answers here run to max_new: no eos
    assert overall[0.0]["tau"] == pytest.approx(len(greedy) * (max_new - 1) / sum(r["target_calls"] for r in greedy))
    json.dumps(result)  # serializable


def test_bench_answers_every_prompt_on_an_empty_suffix_cache(int4_bundle):
    """ar-exact answers a prompt just before spec does: a suffix cache kept between them would hand spec the
    whole answer to copy.  With ``warm`` the cache holds the earlier prompts' answers (asked twice, a prompt
    is copied the second time), never the prompt's own."""
    engine = Engine.from_bundle(int4_bundle, threads=1)
    modes = modes_for(engine, ["trim-64"], engine.config, suffix=True)
    assert [m.name for m in modes] == ["ar", "ar-exact", "spec+trim-64", "spec+trim-64+suffix"]
    assert "suffix" not in modes[2].config.proposers and modes[3].config.proposers[0] == "suffix"
    prompts = load_bench_prompts(None, ["code"], 2)
    result = run_bench(engine, prompts, modes, temperatures=[0.0], max_new_tokens=24)
    spec = [r for r in result["records"] if "tau" in r]
    assert len(spec) == 4 and all(r["identical_to_ar"] for r in spec)
    assert all(r["suffix_accepted"] < 8 for r in spec), spec  # the answer is not copied from ar-exact's
    twice = [prompts[0], prompts[0]]
    warm = run_bench(engine, twice, modes, temperatures=[0.0], max_new_tokens=24, warm=True)["records"]
    suffix = [r for r in warm if r["mode"].endswith("+suffix")]
    assert all(r["identical_to_ar"] for r in suffix)
    assert suffix[0]["suffix_accepted"] < 8 and suffix[1]["suffix_accepted"] >= 16, suffix


def test_bench_times_ar_in_its_own_engine_and_reports_the_schedule_per_prompt(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, config=chain(2, adaptive=True))
    baseline = Engine.from_bundle(int4_bundle, threads=1, mode="ar")
    before = baseline.bundle.target.stats.calls.copy(), engine.bundle.target.stats.calls.copy()
    prompts = load_bench_prompts(None, ["code", "multi-turn"], 1)
    modes = modes_for(engine, ["trim-160"], engine.config, fixed_gammas=[1, 2])
    result = run_bench(engine, prompts, modes, temperatures=[0.0], max_new_tokens=10, baseline=baseline)
    assert sum(baseline.bundle.target.stats.calls.values()) > sum(before[0].values())  # ar ran there ...
    ar_passes = [r["target_passes"] for r in result["records"] if r["mode"] == "ar"]
    assert all(set(p) == {"1"} for p in ar_passes)  # ... as one-row passes: the fastest target-only decoding
    rows = per_prompt_schedule(result["records"])
    assert [r["mode"] for r in rows] == ["spec+trim-160"] and rows[0]["prompts"] == 2
    by_prompt = {(r["mode"], r["prompt_index"]): r["tokens_per_second"] for r in result["records"]}
    expected = min(
        by_prompt[("spec+trim-160", i)] / max(by_prompt[(f"spec+trim-160@γ{g}", i)] for g in (1, 2)) for i in (0, 1)
    )
    assert rows[0]["min"] == pytest.approx(expected)


@pytest.mark.slow
def test_bad_multidraft_flags(int4_bundle):
    assert_one_line_error(
        cli("generate", str(int4_bundle), "hi", "--drafts", "2", "--verifier", "beam"),
        "unknown multi-draft verifier 'beam'",
    )
    assert_one_line_error(
        cli("generate", str(int4_bundle), "hi", "--drafts", "3", "--temperature", "0.7", "--threads", "1"),
        "exactly 2 drafts",
    )


def test_bench_multidraft_modes(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    prompts = load_bench_prompts(None, ["code"], 1)
    multidraft = [TreeConfig(gamma=2, drafts=2, verifier=s) for s in ("rrs", "spechub")]
    modes = modes_for(engine, ["full"], chain(2, adaptive=True), [2], multidraft)
    assert [m.name for m in modes] == ["ar", "ar-exact", "spec@γ2", "spec+k2-rrs@γ2", "spec+k2-spechub@γ2", "spec"]
    result = run_bench(engine, prompts, modes, temperatures=[0.0, 0.7], max_new_tokens=12)
    greedy = [r for r in result["records"] if "tau" in r and r["temperature"] == 0.0]
    assert len(greedy) == 4 and all(r["identical_to_ar"] for r in greedy)
    speculative = [r for r in result["records"] if "tau" in r]
    assert any(r["tau"] > 1 for r in speculative), "no draft was accepted: first-token acceptance not exercised"
    for r in speculative:
        # a round accepts drafts exactly when it accepts its first position, and no round accepts more than γ = 2
        accepted = (r["tau"] - 1) * r["target_calls"]
        assert (r["first_token_acceptance"] > 0) == (accepted > 0.5), r
        assert r["first_token_acceptance"] * r["target_calls"] >= accepted / 2 - 1e-9, r


def test_bench_modes_without_spec_keep_the_drafter_s_other_modes(int4_bundle):
    """``--modes`` without spec leaves out the drafter model's chains without lookup, not its +lookup,
    multi-draft or SSD modes."""
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    tree = TreeConfig(gamma=2, drafts=2, verifier="rrs")

    def names(**kinds) -> list[str]:
        return [m.name for m in modes_for(engine, ["full"], chain(2), [2], [tree], **kinds)]

    assert names(lookup=True) == [
        "ar",
        "ar-exact",
        "spec@γ2",
        "spec+lookup@γ2",
        "spec+k2-rrs@γ2",
        "spec",
        "spec+lookup",
    ]
    assert names(lookup=True, reference=False, spec=False) == ["ar", "spec+lookup@γ2", "spec+k2-rrs@γ2", "spec+lookup"]


@pytest.mark.slow
def test_generate_ssd_with_split_threads(int4_bundle):
    result = cli(
        "generate",
        str(int4_bundle),
        "def is_prime",
        "--max-tokens",
        "8",
        "--mode",
        "ssd",
        "--threads",
        "1",
        "--draft-threads",
        "1",
        "--gamma",
        "2",
    )
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stderr
    assert_one_line_error(
        cli("generate", str(int4_bundle), "hi", "--mode", "ssd", "--draft-threads", "-2"), "--draft-threads"
    )


def test_bench_ssd_modes(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, draft_threads=1, mode="spec")
    # forced hits: every predicted outcome prepared, over a wide fan-out (the tiny model's distributions are
    # flat); forced misses: none prepared.  Timed speculation (the default) would make the hit rate machine-bound.
    forced_hit = SsdConfig(gamma=2, speculations=200, fan_out=24)
    modes = modes_for(engine, ["trim-160"], chain(2), None, (), [forced_hit])
    assert [m.name for m in modes] == ["ar", "ar-exact", "spec+trim-160+ssd@γ2", "spec+trim-160"]
    modes.append(BenchMode("spec+trim-160+ssd-miss@γ2", "trim-160", SsdConfig(gamma=2, speculations=0)))
    result = run_bench(engine, load_bench_prompts(None, ["code"], 1), modes, temperatures=[0.0], max_new_tokens=12)
    ssd = {r["mode"]: r for r in result["records"] if "+ssd" in r["mode"]}
    hit, miss = ssd["spec+trim-160+ssd@γ2"], ssd["spec+trim-160+ssd-miss@γ2"]
    assert hit["identical_to_ar"] and miss["identical_to_ar"]
    assert hit["cache_hit_rate"] > 0 and miss["cache_hit_rate"] == 0.0


def test_bench_repeats_keep_one_record_per_prompt_and_mode(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, threads=1, mode="spec")
    prompts = load_bench_prompts(None, ["code"], 1)
    modes = modes_for(engine, ["trim-64"], chain(2), [1])
    result = run_bench(engine, prompts, modes, temperatures=[0.0], max_new_tokens=8, repeats=2)
    assert sorted(r["mode"] for r in result["records"]) == sorted(m.name for m in modes)
    assert all(r["identical_to_ar"] for r in result["records"] if "tau" in r)
    with pytest.raises(EdgeSpecError, match="repeats"):
        run_bench(engine, prompts, modes, temperatures=[0.0], max_new_tokens=8, repeats=0)


def test_bench_without_matplotlib_writes_the_json_and_says_how_to_get_the_plot(int4_bundle, tmp_path, monkeypatch):
    """matplotlib is the bench extra, which neither README install command installs: without it bench still
    writes bench.json and ends with one line on the skipped plot, not a traceback."""
    from typer.testing import CliRunner

    from edge_spec.cli import app

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # any import of matplotlib raises ImportError
    output = tmp_path / "results"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            str(int4_bundle),
            "--max-tokens",
            "3",
            "--temperature",
            "0",
            "--draft-head",
            "trim-64",
            "--modes",
            "ar,spec",
            "--category",
            "code",
            "--per-category",
            "1",
            "--threads",
            "1",
            "--output",
            str(output),
        ],
    )
    assert result.exit_code == 0 and result.exception is None, (result.exception, result.output)
    records = json.loads((output / "bench.json").read_text())["records"]
    assert {r["mode"] for r in records} == {"ar", "spec+trim-64"}  # --modes ar,spec: no ar-exact reference
    assert not (output / "bench.png").exists()
    skipped = [line for line in result.output.splitlines() if "plot" in line and "skipped" in line]
    assert len(skipped) == 1, result.output
    assert "pip install" in skipped[0] and "edge-spec[bench]" in skipped[0] and "matplotlib" in skipped[0]


def test_cost_normalized_rates_price_every_pass_alike():
    from edge_spec.bench.runs import cost_normalized_seconds, summarize

    # two runs of the same passes, the second slowed down by other load: one price per (decoder, rows)
    fast = {
        "category": "code",
        "temperature": 0.0,
        "mode": "ar",
        "new_tokens": 11,
        "decode_seconds": 1.05,
        "target_passes": {"1": [10, 1.0]},
        "draft_passes": {},
    }
    slow = dict(
        fast,
        mode="spec@γ1",
        decode_seconds=1.55,
        target_passes={"1": [10, 1.5]},
        tau=1.0,
        mbsu=1.0,
        mean_gamma=0.0,
        param_ratio=0.2,
        target_calls=10,
        acceptance_rate=0.0,
        head_seconds=0.0,
        draft_steps=0,
        candidate_recall=1.0,
        identical_to_ar=True,
        identical_to_one_row_ar=True,
    )
    seconds = cost_normalized_seconds([fast, slow])
    assert seconds[id(fast)] == pytest.approx(1.25 + 0.05) and seconds[id(slow)] == pytest.approx(1.25 + 0.05)
    rows = {r["mode"]: r for r in summarize([fast, slow]) if r["category"] == "code"}
    assert rows["spec@γ1"]["speedup_vs_ar"] == pytest.approx(1.05 / 1.55)
    assert rows["spec@γ1"]["normalized_speedup_vs_ar"] == pytest.approx(1.0)


@pytest.mark.slow
def test_flags_a_mode_cannot_honour_are_refused_not_ignored(int4_bundle):
    assert_one_line_error(
        cli("generate", str(int4_bundle), "hi", "--mode", "ssd", "--schedule", "adaptive"),
        "--schedule does not apply to --mode ssd",
    )
    assert_one_line_error(
        cli("generate", str(int4_bundle), "hi", "--mode", "ssd", "--lookup"), "--lookup does not apply to --mode ssd"
    )
    assert_one_line_error(
        cli("generate", str(int4_bundle), "hi", "--drafts", "2", "--lookup"),
        "--lookup does not apply to multi-draft spec",
    )


def test_streamed_answers_print_brackets_as_they_are(capsys):
    """Model text is printed verbatim: code such as ``d[bold]`` or ``arr[i]`` is not console markup."""
    from types import SimpleNamespace

    from edge_spec.cli import output

    class Engine:
        last_stats = SimpleNamespace(
            new_tokens=3, tokens_per_second=1.0, prefill_seconds=0.1, spec=None, coupled_seed=None, stop_reason="eos"
        )

        def generate(self, prompt, **kwargs):
            yield from ["x = arr[i]", " + d[bold]", " [/]"]

        def cancel(self):
            pass

    assert output.stream(Engine(), "hi") == "x = arr[i] + d[bold] [/]"
    assert capsys.readouterr().out == "x = arr[i] + d[bold] [/]\n"


@pytest.mark.slow
def test_misspelt_or_unhonoured_sampler_is_one_line_before_any_load(tmp_path):
    assert_one_line_error(
        cli("generate", str(tmp_path / "nope"), "hi", "--temperature", "0.7", "--sampler", "gumbel"),
        "--sampler must be one of rejection, coupled",
    )
    assert_one_line_error(
        cli("generate", str(tmp_path / "nope"), "hi", "--temperature", "0.7", "--sampler", "coupled", "--drafts", "2"),
        "--sampler coupled applies to --mode ar, ssd and one-chain spec",
    )


def test_export_defaults_are_the_recommended_settings_and_help_states_them():
    """Plain ``edge-spec export`` builds the recommended bundle, and its help shows the defaults the
    exporter really uses (taken from ExportOptions, not typed twice)."""
    import re

    from typer.testing import CliRunner

    from edge_spec import cli as cli_module
    from edge_spec.export.bundle.options import ExportOptions

    defaults = ExportOptions()
    assert (defaults.draft_vocab, defaults.keep, defaults.rank, defaults.candidates, defaults.scorer_vocab) == (
        "specvocab,trim",
        (32768,),
        (192,),
        (128,),
        (65536,),
    )
    result = CliRunner().invoke(cli_module.app, ["export", "--help"], env={"COLUMNS": "300", "NO_COLOR": "1"})
    text = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", result.output))
    for flag, value in (
        ("--draft-vocab", "specvocab,trim"),
        ("--keep", "32768"),
        ("--rank", "192"),
        ("--candidates", "128"),
        ("--scorer-vocab", "65536"),
    ):
        assert re.search(re.escape(flag) + r" \S+ .*?\[default: " + re.escape(value) + r"\]", text), flag
