"""A long benchmark stopped early resumes where it stopped (``edge_spec.bench.journal``), and only under the
settings and on the machine it started with; ``spec_peers.py`` and ``session_peers.py`` skip what their journal
holds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from edge_spec.bench.journal import RunJournal, fingerprint, journal_path, machine
from edge_spec.errors import EdgeSpecError

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SETTINGS = {"threads": 2, "k": [4, 8], "bundle": "/b", "machine": "cpu"}


def test_a_new_run_keeps_each_unit_on_disk_as_it_finishes(tmp_path):
    output = tmp_path / "peers.json"
    journal = RunJournal(output, SETTINGS)
    assert journal.path == journal_path(output) == tmp_path / "peers.json.partial.jsonl"
    assert 0 not in journal
    journal.add(0, [{"engine": "ours", "tokens_per_second": 12.5}])
    journal.add(1, [{"engine": "genai", "tokens_per_second": 11.0}])

    resumed = RunJournal(output, dict(SETTINGS))
    assert 0 in resumed and 1 in resumed and 2 not in resumed
    assert resumed.get(0) == [{"engine": "ours", "tokens_per_second": 12.5}]
    assert resumed.get(1) == [{"engine": "genai", "tokens_per_second": 11.0}]
    resumed.finish()
    assert not resumed.path.exists()
    assert RunJournal(output, SETTINGS).done == {}  # a finished run's next one starts afresh


def test_the_unit_a_stopped_run_was_writing_runs_again(tmp_path):
    output = tmp_path / "peers.json"
    RunJournal(output, SETTINGS).add(0, {"a": 1})
    with journal_path(output).open("a") as handle:
        handle.write('{"key": "1", "value": {"a"')  # cut mid-line

    resumed = RunJournal(output, SETTINGS)
    assert 0 in resumed and 1 not in resumed
    resumed.add(1, {"a": 2})
    assert RunJournal(output, SETTINGS).done == {"0": {"a": 1}, "1": {"a": 2}}
    lines = journal_path(output).read_text().splitlines()
    assert [json.loads(line) for line in lines[1:]] == [
        {"key": "0", "value": {"a": 1}},
        {"key": "1", "value": {"a": 2}},
    ]


def test_a_run_stopped_while_it_wrote_its_settings_starts_afresh(tmp_path):
    output = tmp_path / "peers.json"
    journal_path(output).write_text('{"settings": {"thr')
    journal = RunJournal(output, SETTINGS)
    assert journal.done == {}
    journal.add(0, 1)
    assert RunJournal(output, SETTINGS).done == {"0": 1}


def test_a_run_under_other_settings_is_refused_naming_what_differs(tmp_path):
    output = tmp_path / "peers.json"
    RunJournal(output, SETTINGS).add(0, {"a": 1})
    for changed in ({"threads": 1}, {"machine": "another cpu"}, {"k": [4]}):
        with pytest.raises(EdgeSpecError, match=f"other settings \\({next(iter(changed))}\\).*remove that file"):
            RunJournal(output, {**SETTINGS, **changed})
    with pytest.raises(EdgeSpecError, match="other settings \\(extra\\)"):
        RunJournal(output, {**SETTINGS, "extra": True})
    assert RunJournal(output, SETTINGS).get(0) == {"a": 1}  # refused, not overwritten


def test_a_damaged_line_before_the_last_is_refused(tmp_path):
    output = tmp_path / "peers.json"
    journal = RunJournal(output, SETTINGS)
    journal.add(0, 1)
    journal.add(1, 2)
    lines = journal.path.read_text().splitlines()
    journal.path.write_text("\n".join([lines[0], "not json", lines[2]]) + "\n")
    with pytest.raises(EdgeSpecError, match="line 2 is damaged"):
        RunJournal(output, SETTINGS)


def test_settings_name_the_workload_and_the_machine():
    assert fingerprint([[1, 2], [3]]) == fingerprint([[1, 2], [3]])
    assert fingerprint([[1, 2], [3]]) != fingerprint([[1, 2, 3]])
    assert fingerprint([[1, 2], [3]]) != fingerprint([[1, 2], [4]])
    assert machine().strip()


@pytest.fixture
def scripts(monkeypatch):
    """``spec_peers.py`` and ``session_peers.py``, imported as the scripts import each other."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import session_peers
    import spec_peers

    return spec_peers, session_peers


def peers_args(**changes) -> argparse.Namespace:
    values = dict(
        peers="genai,llamacpp", k=[4, 8], our_k=[], threads=2, new_tokens=128, bundle=Path("b"), repeats=1,
        output=Path("one.json"), report=None, plot=None, plot_title="", prepare=False, worker=None,
    )  # fmt: skip
    values.update(changes)
    return argparse.Namespace(**values)


def test_spec_peers_resumes_only_the_same_measurement(scripts):
    spec_peers, _ = scripts
    items = [{"ids": [1, 2, 3]}, {"ids": [4, 5]}]
    same = spec_peers.run_settings(peers_args(), items)
    assert spec_peers.run_settings(peers_args(output=Path("other.json"), plot=Path("p.png")), items) == same
    assert spec_peers.run_settings(peers_args(bundle=Path("b").resolve()), items) == same
    for changed in (peers_args(threads=1), peers_args(k=[4]), peers_args(bundle=Path("c")), peers_args(new_tokens=64)):
        assert spec_peers.run_settings(changed, items) != same
    assert spec_peers.run_settings(peers_args(), [{"ids": [1, 2, 3]}, {"ids": [4, 6]}]) != same


def test_session_peers_replays_only_the_sessions_its_journal_lacks(scripts, tmp_path, monkeypatch):
    _, session_peers = scripts
    sessions = [
        {"id": f"s{i}", "category": "chat", "max_tokens": 8, "turns": [{"role": "user", "content": f"hello {i}"}]}
        for i in range(3)
    ]
    args = argparse.Namespace(output=tmp_path / "run", warm=False, turns=None, max_tokens=None, ctx=4096, bundle=None)
    monkeypatch.setattr("edge_spec.bench.journal.machine", lambda: "cpu")
    monkeypatch.setattr("edge_spec.bench.sessions.turn_messages", lambda session, t, answers: session["turns"])

    class Tokenizer:
        def encode_chat(self, messages, tools=None):
            return [len(m["content"]) for m in messages]

        def decode(self, ids):
            return "answer"

    asked = []

    def runner(ids, messages, tools, new_tokens):
        asked.append(messages[0]["content"])
        if messages[0]["content"] == "hello 1" and len(asked) == 2:
            raise KeyboardInterrupt  # the run is stopped during the second session
        return {"ids": [7, 8], "new_tokens": 2, "decode_seconds": 0.1}

    args.output.mkdir()
    journal = session_peers.open_journal(args, sessions)
    with pytest.raises(KeyboardInterrupt):
        session_peers.replay(sessions, {"ours spec": runner}, None, Tokenizer(), args, journal)
    assert asked == ["hello 0", "hello 1"]

    journal = session_peers.open_journal(args, sessions)
    records = session_peers.replay(sessions, {"ours spec": runner}, None, Tokenizer(), args, journal)
    assert asked == ["hello 0", "hello 1", "hello 1", "hello 2"]  # the first session is not asked again
    assert [r["session"] for r in records["ours spec"]] == ["s0", "s1", "s2"]

    with pytest.raises(SystemExit, match="other settings \\(threads\\)"):
        session_peers.open_journal(argparse.Namespace(**{**vars(args), "threads": 1}), sessions)
    warm = argparse.Namespace(**{**vars(args), "warm": True, "output": tmp_path / "warm"})
    session_peers.open_journal(warm, sessions).add(0, {"ours spec": []})
    with pytest.raises(SystemExit, match="--warm run cannot resume"):
        session_peers.open_journal(warm, sessions)
