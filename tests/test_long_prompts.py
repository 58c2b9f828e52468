"""The ``long`` bench category (``edge_spec.bench.long_prompts``): code files of Python's standard
library cut to a budget, asked for by name only (``edge-spec bench --category long``, ``spec_peers.py
--category long``), never part of a default run."""

from __future__ import annotations

import argparse
import importlib
import inspect
from pathlib import Path

import pytest

from edge_spec.bench import long_prompts
from edge_spec.bench.long_prompts import CATEGORY, CHAR_BUDGET, SOURCES, excerpt
from edge_spec.bench.runs import load_bench_prompts

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def code_of(prompt: str) -> str:
    """The fenced code of a long prompt, without the fence's file-name comment."""
    fenced = prompt.split("```python\n", 1)[1].rsplit("```", 1)[0]
    return fenced.split("\n", 1)[1]


def test_the_prompts_are_the_same_every_time_and_whole_lines_of_their_source():
    first, again = long_prompts.long_prompts(), long_prompts.long_prompts()
    assert first == again
    assert 4 <= len(first) <= 6 and {p["category"] for p in first} == {CATEGORY}
    assert len({p["prompt"] for p in first}) == len(first)
    for item, (module, name, instruction) in zip(first, SOURCES):
        source = inspect.getsource(getattr(importlib.import_module(module), name))
        code = code_of(item["prompt"])
        assert item["prompt"].startswith(instruction)
        assert len(code) <= CHAR_BUDGET
        assert source.startswith(code.rstrip("\n")) and source[len(code.rstrip("\n"))] == "\n"  # whole lines
        assert len(code) > CHAR_BUDGET * 0.75 or len(source) <= CHAR_BUDGET  # cut near the budget, not far before


def test_an_excerpt_ends_before_a_definition_with_its_decorators_and_comment():
    source = (
        "class A:\n"
        "    x = 1\n"
        "\n"
        "    def one(self):\n"
        "        return 1\n"
        "\n"
        "    # the second one\n"
        "    @property\n"
        "    def two(self):\n"
        "        return 2\n"
    )
    cut_in_two = source.index("        return 2")  # a budget that ends inside the second method
    assert excerpt(source, cut_in_two) == source[: source.index("    # the second one")].rstrip() + "\n"
    assert excerpt(source, len(source)) == source
    assert excerpt("a = 1\nb = 2\nc = 3\n", 8) == "a = 1\n"  # no definition: the last whole line


def test_the_prompts_hold_1500_to_3000_tokens_of_the_default_pairs_tokenizer():
    """Measured with the README bundle's tokenizer and chat template, where that bundle is exported."""
    from edge_spec.paths import DEFAULT_BUNDLE
    from edge_spec.prompts import as_messages
    from edge_spec.runtime.text import TextTokenizer

    if not (Path(DEFAULT_BUNDLE) / "tokenizer.json").is_file():
        pytest.skip("the default bundle is not exported here")
    tokenizer = TextTokenizer(DEFAULT_BUNDLE)
    for item in long_prompts.long_prompts():
        assert 1500 <= len(tokenizer.encode_chat(as_messages(item["prompt"]))) <= 3000, item["source"]


def test_a_python_without_its_library_sources_is_told_in_one_line(monkeypatch):
    def no_source(obj):
        raise OSError("could not get source code")

    monkeypatch.setattr(long_prompts.inspect, "getsource", no_source)
    with pytest.raises(long_prompts.EdgeSpecError, match="need Python's library sources"):
        long_prompts.long_prompts()


def test_edge_spec_bench_runs_the_long_category_only_when_named():
    default = load_bench_prompts(None, None, None)
    assert CATEGORY not in {p["category"] for p in default}
    named = load_bench_prompts(None, [CATEGORY], None)
    assert named == long_prompts.long_prompts()
    mixed = load_bench_prompts(None, [CATEGORY, "code"], 1)
    assert [p["category"] for p in mixed] == ["code", CATEGORY]


def test_a_prompt_file_with_its_own_long_category_keeps_it(tmp_path):
    own = tmp_path / "prompts.jsonl"
    own.write_text('{"category": "long", "prompt": "mine"}\n')
    assert load_bench_prompts(own, [CATEGORY], None) == [{"category": "long", "prompt": "mine"}]


def test_spec_peers_takes_the_long_category_when_asked(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import spec_peers

    def chosen(*category, per_category=None):
        args = argparse.Namespace(prompts=None, category=list(category), per_category=per_category)
        return [item["category"] for item in spec_peers.load_prompts(args)]

    assert CATEGORY not in chosen()
    assert chosen(CATEGORY) == [CATEGORY] * len(SOURCES)
    assert chosen(CATEGORY, "code", per_category=1) == ["code", CATEGORY]
