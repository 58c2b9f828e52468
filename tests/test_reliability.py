"""Reliability (issue #17): what export and add-heads do to the paths they are given, partial work left
behind, one engine shared by threads, and flags and inputs refused in one line before any slow work."""

from __future__ import annotations

import shutil

import pytest

from edge_spec.errors import EdgeSpecError
from tests import tiny_models


def _models(tiny_pair):
    tokenizer, target, draft = tiny_pair
    return {"tiny-target": tiny_models.loaded("tiny-target", target, tokenizer),
            "tiny-draft": tiny_models.loaded("tiny-draft", draft, tokenizer)}


def _export(out, tiny_pair, loader=None, **options):
    from edge_spec.export.bundle import ExportOptions, export_bundle

    loader = loader or _models(tiny_pair).__getitem__
    options = {"context_length": 64, "quant": "fp32", **options}
    return export_bundle("tiny-target", "tiny-draft", out, ExportOptions(**options), loader=loader)


def _never(source):
    raise AssertionError(f"loaded {source} before checking --out")


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir())


# -- export --out -----------------------------------------------------------------------------------


def test_export_refuses_a_directory_that_is_not_a_bundle(tmp_path, tiny_pair):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(EdgeSpecError, match="not an edge-spec bundle"):
        _export(out, tiny_pair, loader=_never)
    assert (out / "notes.txt").read_text() == "keep me" and (out / "sub").is_dir()
    assert _siblings(out) == ["mine"]


def test_export_resolves_dotdot_before_removing_anything(tmp_path, tiny_pair):
    parent = tmp_path / "parent"
    (parent / "x").mkdir(parents=True)
    (parent / "notes.txt").write_text("keep me")
    with pytest.raises(EdgeSpecError, match="not an edge-spec bundle"):
        _export(parent / "x" / "..", tiny_pair, loader=_never)
    assert (parent / "notes.txt").read_text() == "keep me" and (parent / "x").is_dir()


def test_export_refuses_a_file_before_loading(tmp_path, tiny_pair):
    target = tmp_path / "somefile.txt"
    target.write_text("x")
    with pytest.raises(EdgeSpecError, match="not a directory"):
        _export(target, tiny_pair, loader=_never)
    assert target.read_text() == "x"
    assert _siblings(target) == ["somefile.txt"]


def test_export_to_dot(tmp_path, tiny_pair, monkeypatch):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    monkeypatch.chdir(busy)
    with pytest.raises(EdgeSpecError, match="not an edge-spec bundle"):
        _export(".", tiny_pair, loader=_never)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    _export(".", tiny_pair)
    assert (empty / "manifest.json").is_file()
    assert _siblings(empty) == ["busy", "empty"]


def test_failed_export_keeps_the_old_bundle_and_leaves_nothing_behind(tmp_path, tiny_pair):
    from edge_spec.manifest import read_manifest, verify_files

    out = tmp_path / "bundle"
    _export(out, tiny_pair)
    before = (out / "manifest.json").read_text()
    models = _models(tiny_pair)

    def failing(source):
        if source == "tiny-draft":
            raise EdgeSpecError("drafter download failed")
        return models[source]

    with pytest.raises(EdgeSpecError, match="drafter download failed"):
        _export(out, tiny_pair, loader=failing)
    assert (out / "manifest.json").read_text() == before
    verify_files(out, read_manifest(out), full_hash=True)
    assert _siblings(out) == ["bundle"]
    _export(out, tiny_pair, context_length=32)  # a bundle is replaced by a complete new one
    assert read_manifest(out)["context_length"] == 32
    verify_files(out, read_manifest(out), full_hash=True)
    assert _siblings(out) == ["bundle"]


# -- add-heads, info --------------------------------------------------------------------------------


def test_add_heads_interrupted_leaves_the_bundle_as_it_was(tmp_path, tiny_pair):
    from edge_spec.export.bundle import ExportOptions, add_draft_heads
    from edge_spec.manifest import read_manifest, verify_files

    bundle = tmp_path / "bundle"
    _export(bundle, tiny_pair)
    before = (bundle / "manifest.json").read_text()
    names = sorted(p.relative_to(bundle) for p in bundle.rglob("*"))
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("def f(x):\nThe quick brown fox\n")
    options = ExportOptions(draft_vocab="specvocab", rank=(16,), candidates=(48,), calibration=calibration,
                            calibration_tokens=8)

    def killed(message):
        if message.startswith("SpecVocab: collecting"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        add_draft_heads(bundle, options, "tiny-draft", progress=killed, loader=_models(tiny_pair).__getitem__)
    assert (bundle / "manifest.json").read_text() == before
    assert sorted(p.relative_to(bundle) for p in bundle.rglob("*")) == names
    verify_files(bundle, read_manifest(bundle), full_hash=True)
    assert _siblings(bundle) == ["bundle", "calibration.txt"]

    manifest = add_draft_heads(bundle, options, "tiny-draft", loader=_models(tiny_pair).__getitem__)  # and it still works
    assert "specvocab-r16-k48" in manifest["draft"]["heads"]
    verify_files(bundle, read_manifest(bundle), full_hash=True)
    assert _siblings(bundle) == ["bundle", "calibration.txt"]


def test_info_checks_the_files_like_generate(tmp_path, fp32_bundle):
    from edge_spec import cli

    broken = tmp_path / "broken"
    shutil.copytree(fp32_bundle, broken)
    data = broken / "draft" / "head_full.onnx.data"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(EdgeSpecError, match="size differs"):
        cli.info(broken)


# -- one engine, several callers --------------------------------------------------------------------

PROMPTS = ["def is_prime(n):", "The quick brown fox", "What is 12 * 7?", "Summarize: speculative decoding drafts",
           "import numpy as np"]


@pytest.fixture(scope="module")
def spec_engine(fp32_bundle):
    from edge_spec.runtime.engine import Engine

    return Engine.from_bundle(fp32_bundle, threads=1, mode="spec")


def test_threads_share_one_engine(spec_engine):
    """4 threads x 5 requests through one engine: every answer is its sequential greedy answer."""
    import threading

    expected = {p: spec_engine.complete(p, max_new_tokens=12).token_ids for p in PROMPTS}
    got: dict[tuple[int, int], list[int]] = {}
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for r in range(5):
                prompt = PROMPTS[(w + r) % len(PROMPTS)]
                result = spec_engine.complete(prompt, max_new_tokens=12)
                got[w, r] = (prompt, result.token_ids, result.stats.new_tokens)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(got) == 20
    for prompt, ids, new_tokens in got.values():
        assert ids == expected[prompt] and new_tokens == len(ids)


def test_a_busy_engine_waits_or_says_so(spec_engine):
    import threading

    from edge_spec.runtime.engine import EngineBusy

    expected = spec_engine.complete(PROMPTS[1], max_new_tokens=8).text
    first = spec_engine.generate(PROMPTS[0], max_new_tokens=20)
    next(first)  # a generation in progress
    outcome: dict[str, object] = {}

    def impatient() -> None:
        try:
            spec_engine.complete(PROMPTS[1], max_new_tokens=8, wait=False)
        except EngineBusy as exc:
            outcome["busy"] = str(exc)

    t = threading.Thread(target=impatient)
    t.start()
    t.join(timeout=60)
    assert "busy" in outcome.get("busy", "")

    patient = threading.Thread(target=lambda: outcome.update(text=spec_engine.complete(PROMPTS[1], max_new_tokens=8).text))
    patient.start()
    patient.join(timeout=1.0)
    assert patient.is_alive()  # waits for the generation in progress
    list(first)
    patient.join(timeout=60)
    assert outcome["text"] == expected


def test_a_superseded_generator_raises(spec_engine):
    from edge_spec.runtime.engine import GenerationSuperseded

    expected = spec_engine.complete(PROMPTS[2], max_new_tokens=10).text
    first = spec_engine.generate(PROMPTS[0], max_new_tokens=40)
    next(first)
    assert "".join(spec_engine.generate(PROMPTS[2], max_new_tokens=10)) == expected  # the newer one wins
    with pytest.raises(GenerationSuperseded):
        list(first)
    assert spec_engine.complete(PROMPTS[2], max_new_tokens=10).text == expected  # and the engine still works


def test_stop_string_is_one_stop(spec_engine):
    full = spec_engine.complete(PROMPTS[0], max_new_tokens=30).text
    assert set("the") & set(full)  # a one-letter stop would cut this answer
    one = spec_engine.complete(PROMPTS[0], max_new_tokens=30, stop="the").text
    assert one == spec_engine.complete(PROMPTS[0], max_new_tokens=30, stop=["the"]).text
    assert full.startswith(one) and ("the" in full or one == full)


# -- the command line: inputs and flags refused in one line before the bundle loads ------------------


def _cli(monkeypatch, capsys, *args, stdin: bytes | None = None):
    """Run ``edge-spec ARGS`` in this process: (exit code, stdout, stderr)."""
    import io
    import sys

    from edge_spec import cli

    monkeypatch.setattr(sys, "argv", ["edge-spec", *args])
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    with pytest.raises(SystemExit) as exited:
        cli.main()
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


@pytest.fixture
def no_load(monkeypatch):
    """Loading a bundle fails the test: what is checked must be checked before the (slow) load."""
    from edge_spec.runtime.engine import Engine

    def refuse(*args, **kwargs):
        raise AssertionError("the bundle was loaded before the mistake was found")

    monkeypatch.setattr(Engine, "from_bundle", refuse)


def _one_line(code, err, fragment):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], err


@pytest.mark.parametrize("args, fragment", [
    (("",), "prompt is empty"),
    (("   ",), "prompt is empty"),
    (("\udcff\udcfe hi",), "not UTF-8"),
    (("hi", "--stop", ""), "--stop"),
    (("hi", "--threads", "100000"), "--threads"),
    (("hi", "--threads", "2147483648"), "--threads"),
    (("hi", "--draft-threads", "100000"), "--draft-threads"),
    (("hi", "--gamma", "254"), "--gamma"),
])
def test_generate_refuses_before_loading(monkeypatch, capsys, no_load, fp32_bundle, args, fragment):
    _one_line(*_cli(monkeypatch, capsys, "generate", str(fp32_bundle), *args)[::2], fragment)


def test_generate_refuses_non_utf8_stdin(monkeypatch, capsys, no_load, fp32_bundle):
    code, _, err = _cli(monkeypatch, capsys, "generate", str(fp32_bundle), "-", stdin=b"caf\xe9 au lait\n")
    _one_line(code, err, "not UTF-8")


def test_generate_interrupted_exits_130(monkeypatch, capsys, fp32_bundle):
    import os
    import signal
    import time

    from edge_spec import cli
    from edge_spec.runtime.engine import GenerationStats

    class Interrupted:
        """An engine whose user presses Ctrl-C after the first chunk."""

        def __init__(self):
            self.cancelled = False
            self.last_stats = GenerationStats()

        def cancel(self):
            self.cancelled = True

        def generate(self, prompt, **kwargs):
            yield "partial"
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 5
            while not self.cancelled and time.monotonic() < deadline:
                time.sleep(0.001)
            self.last_stats = GenerationStats(new_tokens=1, stop_reason="cancelled" if self.cancelled else "length")

    monkeypatch.setattr(cli, "_load_engine", lambda *args, **kwargs: Interrupted())
    code, out, err = _cli(monkeypatch, capsys, "generate", str(fp32_bundle), "hi")
    assert code == 130
    assert "partial" in out and "cancelled" in err.splitlines()[-1]


@pytest.mark.parametrize("options, fragment", [
    ({"context_length": 0}, "--context-length"),
    ({"context_length": -5}, "--context-length"),
    ({"quant": "int4", "block_size": 7}, "--block-size"),
    ({"quant": "int8", "block_size": 0}, "--block-size"),
])
def test_export_flags_checked_before_loading(tmp_path, tiny_pair, options, fragment):
    with pytest.raises(EdgeSpecError, match=fragment):
        _export(tmp_path / "out", tiny_pair, loader=_never, **options)
    assert list(tmp_path.iterdir()) == []


# -- bench inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, fragment", [
    ('{"category": "code", "prompt": "hi"}\n{"category": "code"}\n', "line 2"),
    ('{"category": "code", "prompt": "hi"}\nnot json\n', "line 2: invalid JSON"),
    ('["a list"]\n', "line 1"),
    ("", "no prompts"),
    ("\n\n", "no prompts"),
])
def test_bench_prompt_file_mistakes(tmp_path, text, fragment):
    from edge_spec.bench import load_bench_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(EdgeSpecError, match=fragment):
        load_bench_prompts(path, None, None)


def test_bench_output_must_be_a_directory(monkeypatch, capsys, no_load, tmp_path, fp32_bundle):
    taken = tmp_path / "results.txt"
    taken.write_text("x")
    code, _, err = _cli(monkeypatch, capsys, "bench", str(fp32_bundle), "--output", str(taken))
    _one_line(code, err, "not a directory")
    assert taken.read_text() == "x"
