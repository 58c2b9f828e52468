"""A machine kind's headline row (``edge_spec.bench.headline``) and the resumable run that feeds it
(``benchmarks/machine_kind.py``): each ratio against the fastest peer mode of the same run, first tokens against
the soonest peer mode's, sessions pooled by tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from edge_spec.bench.headline import (
    HEADER,
    OURS_PROMPTS,
    ar_against_genai,
    headline_row,
    lead,
    lowest_category,
    pooled_sessions,
)

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def row(category: str, engine: str, speed: float, first_ms: float | None = 100.0) -> dict:
    return {"category": category, "engine": engine, "tokens_per_second": speed, "first_token_ms": first_ms}


SUMMARY = [
    row("qa", OURS_PROMPTS, 60.0, 120.0),
    row("qa", "ours ar", 50.0, 110.0),
    row("qa", "genai ar", 40.0, 260.0),
    row("qa", "llamacpp ngram-mod", 45.0, 200.0),
    row("code", OURS_PROMPTS, 100.0, 130.0),
    row("code", "ours ar", 50.0, 115.0),
    row("code", "genai ar", 40.0, 250.0),
    row("code", "openvino K4", 44.0, 90.0),
    row("overall", OURS_PROMPTS, 80.0, 125.0),
    row("overall", "ours ar", 50.0, 112.0),
    row("overall", "genai ar", 40.0, 255.0),
    row("overall", "llamacpp ngram-mod", 42.0, 210.0),
    row("overall", "openvino K4", 41.0, 95.0),
]


def test_the_lead_is_over_the_fastest_peer_mode_and_the_first_token_against_the_soonest():
    overall = lead(SUMMARY, "overall", OURS_PROMPTS)
    assert overall.peer == "llama.cpp ngram-mod" and overall.peer_speed == 42.0
    assert overall.ratio == pytest.approx(80 / 42)
    assert (overall.first_token_ms, overall.soonest_peer_ms) == (125.0, 95.0)  # OpenVINO's, not ngram-mod's
    assert lead(SUMMARY, "code", OURS_PROMPTS).peer == "OpenVINO GenAI K=4"


def test_the_lowest_category_and_our_ar_against_genai():
    lowest = lowest_category(SUMMARY, OURS_PROMPTS)
    assert (lowest.category, lowest.ratio) == ("qa", pytest.approx(60 / 45))
    assert ar_against_genai(SUMMARY) == pytest.approx(50 / 40)
    assert ar_against_genai(SUMMARY, "qa") == pytest.approx(50 / 40)
    assert ar_against_genai([r for r in SUMMARY if r["engine"] != "genai ar"]) is None


def test_a_run_without_peers_or_without_our_default_is_refused():
    with pytest.raises(ValueError, match="needs 'ours schedule\\+suffix' and a peer mode"):
        lead([r for r in SUMMARY if r["engine"].startswith("ours")], "overall", OURS_PROMPTS)
    with pytest.raises(ValueError, match="needs"):
        lead([r for r in SUMMARY if r["engine"] != OURS_PROMPTS], "overall", OURS_PROMPTS)


def turn(category: str, engine: str, tokens: int, seconds: float, first: float) -> dict:
    return {
        "category": category, "engine": engine, "new_tokens": tokens + 1, "first_tokens": 1,
        "decode_seconds": seconds, "first_token_seconds": first,
    }  # fmt: skip


def test_sessions_pool_tokens_over_categories_not_ratios():
    records = [
        turn("agent", "ours spec", 100, 1.0, 0.5),
        turn("edit", "ours spec", 300, 1.0, 2.5),
        turn("agent", "llamacpp ar", 100, 2.0, 1.0),
        turn("edit", "llamacpp ar", 300, 8.0, 4.0),
        turn("actions", "ours spec", 50, 1.0, 0.2),
        turn("actions", "llamacpp ar", 50, 2.0, 0.4),
    ]
    rows = pooled_sessions(records, ("agent", "edit"), "agent and edit")
    pooled = lead(rows, "agent and edit", "ours spec")
    assert pooled.ours == pytest.approx(400 / 2.0) and pooled.peer_speed == pytest.approx(400 / 10.0)
    assert pooled.ratio == pytest.approx(5.0)  # the mean of the per-category ratios would be 3.0
    assert pooled.first_token_ms == pytest.approx(1500.0) and pooled.soonest_peer_ms == pytest.approx(2500.0)
    with pytest.raises(ValueError, match="no turns"):
        pooled_sessions(records, ("chat",), "chat")

    line = headline_row("kind", SUMMARY, SUMMARY, records)
    assert line.count("|") == HEADER.splitlines()[0].count("|")
    assert "**1.905x** (80.00 against llama.cpp ngram-mod's 42.00 tok/s)" in line
    assert "1.333x qa" in line and "125 / 95" in line and "**1.25x**" in line
    assert "**5.000x**, first token 1.50 / 2.50 s; **2.000x**" in line
    assert headline_row("kind", SUMMARY, None, None).endswith("| - | - |")
    assert "**1.905x**; 0.12 / 0.10 (timed once) |" in line
    sooner = [dict(r, first_token_ms=r["first_token_ms"] / 2) for r in SUMMARY]
    assert "**1.905x**; 0.06 / 0.05 |" in headline_row("kind", SUMMARY, SUMMARY, records, sooner)


@pytest.fixture
def machine_kind(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import machine_kind

    return machine_kind


def test_a_stopped_run_goes_on_at_the_first_step_without_output(machine_kind, fp32_bundle, tmp_path, monkeypatch):
    calls = tmp_path / "calls.txt"
    writer = tmp_path / "writer.py"
    writer.write_text(
        "import sys, pathlib\n"
        f"pathlib.Path({str(calls)!r}).open('a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "if '--fail' in sys.argv: print('it broke'); sys.exit(3)\n"
        "if '--output' in sys.argv: pathlib.Path(sys.argv[sys.argv.index('--output') + 1]).write_text('{}')\n"
        "else: print('profile')\n"
    )
    plan = [
        machine_kind.Step("a.json", str(writer), ("first",)),
        machine_kind.Step("b.log", str(writer), ("second",), log_only=True),
        machine_kind.Step("c.json", str(writer), ("third", "--fail")),
    ]
    monkeypatch.setattr(machine_kind, "steps", lambda bundle, threads: plan)
    monkeypatch.setattr(machine_kind, "report", lambda directory, kind: "row\n")
    out = tmp_path / "kind"
    monkeypatch.setattr(sys, "argv", ["machine_kind.py", "--output", str(out), "--bundle", str(fp32_bundle)])
    with pytest.raises(SystemExit, match="c.json: .* exit code 3; its printout is in .*c.json.log"):
        machine_kind.main()
    assert (out / "a.json").read_text() == "{}" and (out / "b.log").read_text() == "profile\n"
    assert "it broke" in (out / "c.json.log").read_text() and not (out / "c.json").exists()

    plan[2] = machine_kind.Step("c.json", str(writer), ("third",))
    machine_kind.main()
    assert [line.split()[0] for line in calls.read_text().splitlines()] == ["first", "second", "third", "third"]

    plan[1] = machine_kind.Step("d.log", str(writer), ("fourth", "--fail"), log_only=True)
    with pytest.raises(SystemExit, match="d.log"):
        machine_kind.main()
    assert not (out / "d.log").exists()  # a failed profile leaves its printout aside, not as the step's output


def test_a_bare_machine_is_prepared_first_and_a_missing_bundle_refused_in_one_line(machine_kind, tmp_path, monkeypatch):
    plan = machine_kind.steps("BUNDLE", 2)
    assert plan[0].output == "prepare.log" and plan[0].log_only and "--prepare" in plan[0].arguments
    assert all("--prepare" not in step.arguments for step in plan[1:])  # measured after every peer is built
    monkeypatch.setattr(machine_kind, "run", lambda directory, step: pytest.fail("ran a step without a bundle"))
    missing = tmp_path / "no-bundle"
    monkeypatch.setattr(sys, "argv", ["machine_kind.py", "--output", str(tmp_path / "kind"), "--bundle", str(missing)])
    with pytest.raises(SystemExit, match=f"^bundle not found: {missing}$"):
        machine_kind.main()


def test_the_report_reads_the_runs_a_kind_left(machine_kind, tmp_path):
    out = tmp_path / "kind"
    with pytest.raises(SystemExit, match="no .*peers-52.json yet"):
        machine_kind.report(out, "kind")
    out.mkdir()
    (out / "peers-52.json").write_text(json.dumps({"summary": SUMMARY}))
    text = machine_kind.report(out, "Zen 5")
    assert text.startswith(HEADER) and "| Zen 5 | **1.905x**" in text and "| qa | 60.00 | 50.00 |" in text
